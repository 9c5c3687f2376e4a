"""MLflow's tracking server as `air server` runs it: one process that imports MLflow once and serves its
app with uvicorn on the server's Unix socket (air.server.mlflow_server starts it under air's guard).

    python -m air.server.mlflow_app --store URI --socket PATH --artifacts URI      (air server)
    python -m air.server.mlflow_app --store URI --host H --port P --artifacts URI
        --artifact-root URI --static-prefix '' [--workers N]                          (air ui)

Why not `mlflow server`: its CLI is a process of its own that imports all of MLflow's server (the Flask
app, its handlers and stores: seconds of CPU), opens the store and checks its schema, only to start
uvicorn as a second process that imports and checks it all again; and the air server imported MLflow's
client a third time to prepare the store before it. Here it is done once, in the process that serves,
with what `mlflow server --serve-artifacts --static-prefix /mlflow --workers 1` gives its worker: the same
FastAPI app (mlflow.server.fastapi_app: MLflow's Flask app and its routers, as the door's route table
test reads them), the same settings (the variables below, which MLflow's CLI hands its workers), and
MLflow's own uvicorn log format (so the server's log reads as before). MLflow's job runner stays off
(air.tracking.ui.ui_environment); asked for (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true), this process becomes
`mlflow server` with the same settings, which starts it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import uuid
from collections.abc import Mapping, Sequence

#: Where MLflow proxies artifacts to clients: nodes upload through the door, never into a folder.
PROXIED_ARTIFACTS = "mlflow-artifacts:/"


def mlflow_environ(store: str, artifacts: str, prefix: str, artifact_root: str = PROXIED_ARTIFACTS) -> dict[str, str]:
    """The variables MLflow's `mlflow server` hands its workers (mlflow.server._run_server and
    mlflow.server.constants), for `--backend-store-uri store --serve-artifacts --artifacts-destination
    artifacts --default-artifact-root artifact_root --static-prefix prefix`. Named here as strings: the
    module that names them (mlflow.server.constants) cannot be imported without building MLflow's app, which
    reads them while it is built. tests/server/test_mlflow_ready.py checks them against MLflow's names."""
    return {
        "_MLFLOW_SERVER_FILE_STORE": store,
        "_MLFLOW_SERVER_REGISTRY_STORE": store,
        "_MLFLOW_SERVER_ARTIFACT_ROOT": artifact_root,
        "_MLFLOW_SERVER_SERVE_ARTIFACTS": "true",
        "_MLFLOW_SERVER_ARTIFACT_DESTINATION": artifacts,
        **({"_MLFLOW_STATIC_PREFIX": prefix} if prefix else {}),
        "_MLFLOW_SGI_NAME": "uvicorn",
        "_MLFLOW_SERVER_BOOT_ID": uuid.uuid4().hex,
        "_MLFLOW_IN_JOB_EXECUTOR": "false",
        "MLFLOW_ENABLE_WORKSPACES": "false",
    }


def serve(store: str, artifacts: str, prefix: str, *, socket_path: str | None = None, host: str = "127.0.0.1",
          port: int = 0, artifact_root: str = PROXIED_ARTIFACTS, workers: int = 1) -> None:
    """Serve MLflow over `store` on the Unix socket `socket_path` (else on `host`:`port`) until stopped
    (SIGTERM: uvicorn's own graceful stop). More than one worker: uvicorn's worker processes, each
    importing MLflow's app (what `mlflow server --workers N` does)."""
    os.environ.update(mlflow_environ(store, artifacts, prefix, artifact_root))
    from air.tracking.store import prepare_store

    try:
        prepare_store(store)  # the embedded store made (under its lock) and in WAL mode, as every air process does
    except Exception as exc:  # MLflow's own opening of it below says what is wrong, in its words
        print(f"air: preparing {store} failed: {exc}", file=sys.stderr, flush=True)
    import uvicorn

    found = importlib.util.find_spec("mlflow")  # MLflow's own uvicorn log format, found without importing it
    log_config = os.path.join(os.path.dirname(found.origin or ""), "server/uvicorn_log_config.yaml") if found else ""
    log = log_config if os.path.exists(log_config) else None
    if workers > 1:  # uvicorn's worker processes import the app; this one only watches them
        uvicorn.run("mlflow.server.fastapi_app:app", workers=workers, uds=socket_path, host=host, port=port,
                    log_config=log)
        return
    from mlflow.server import handlers
    from mlflow.server.fastapi_app import app

    # The store opened (its schema checked) before the socket is bound: the first request does not pay.
    handlers.initialize_backend_stores(store, store, artifact_root)
    uvicorn.run(app, uds=socket_path, host=host, port=port, log_config=log)


def job_runner_on(environ: Mapping[str, str]) -> bool:
    """Whether MLflow's job runner was asked for (MLFLOW_SERVER_ENABLE_JOB_EXECUTION, read as MLflow reads
    it; air sets it false unless it is set, air.tracking.ui.ui_environment): only `mlflow server` starts it."""
    return environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "true").strip().lower() in ("true", "1")


def cli_argv(store: str, artifacts: str, prefix: str, *, socket_path: str | None = None, host: str = "127.0.0.1",
             port: int = 0, artifact_root: str = PROXIED_ARTIFACTS, workers: int = 1) -> list[str]:
    """The same server through `mlflow server` (its CLI, uvicorn, and the job runner it starts): what this
    module runs when the job runner is asked for."""
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--serve-artifacts",
            "--artifacts-destination", artifacts, "--default-artifact-root", artifact_root, "--workers", str(workers)]
    if prefix:
        argv += ["--static-prefix", prefix]
    if socket_path:  # uvicorn binds only the socket when given --uds (the host and port are then unused)
        return argv + ["--host", "127.0.0.1", "--port", "0", "--uvicorn-opts", f"--uds {shlex.quote(socket_path)}"]
    return argv + ["--host", host, "--port", str(port)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m air.server.mlflow_app", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="the backend store URI")
    parser.add_argument("--socket", help="the Unix socket to serve on (in a 0700 folder)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on without --socket")
    parser.add_argument("--port", type=int, default=5000, help="the port to serve on without --socket")
    parser.add_argument("--artifacts", required=True, help="where proxied artifacts are kept (a file: URI)")
    parser.add_argument("--artifact-root", default=PROXIED_ARTIFACTS, help="new experiments' artifact root")
    parser.add_argument("--static-prefix", default="/mlflow", help="the path MLflow serves under ('': none)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (1: this one)")
    args = parser.parse_args(argv)
    if job_runner_on(os.environ):  # MLflow's CLI starts it (and its 8 processes) beside its server
        from air.tracking.store import prepare_store

        prepare_store(args.store)
        command = cli_argv(args.store, args.artifacts, args.static_prefix, socket_path=args.socket, host=args.host,
                           port=args.port, artifact_root=args.artifact_root, workers=args.workers)
        os.execv(command[0], command)
    serve(args.store, args.artifacts, args.static_prefix, socket_path=args.socket, host=args.host, port=args.port,
          artifact_root=args.artifact_root, workers=args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
