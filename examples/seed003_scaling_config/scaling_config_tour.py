"""Seed 003: try every ScalingConfig setting of the document on a Ray cluster that air starts, and
print what happened to each: scheduled (where, on which devices, with which backend) or refused (why).

    python scaling_config_tour.py                  # this machine's GPUs; without one, 2 fake "H100"s
    python scaling_config_tour.py --gpus 16 --gpu-type H100 --remote   # a `ray` profile's cluster
    python scaling_config_tour.py --fake-gpus 4    # CPU only: the node advertises 4 fake H100
    python scaling_config_tour.py --quick          # CI: 5 of the settings, about a minute

The cluster comes from `ray_launch`: its nodes advertise their GPUs and `accelerator_type:<MODEL>`,
so `use_gpu`, `resources_per_worker`, fractional GPUs and `accelerator_type` schedule as on any Ray
cluster. On fake GPUs (AIR_FAKE_GPUS: the node advertises GPUs that torch cannot use) the workers
still get their GPU ids and CUDA_VISIBLE_DEVICES, but NCCL cannot start, so rows that would use it
run with gloo, marked `nccl→gloo (fake GPUs)`; the explicit `TorchConfig(backend="gloo")` row is the
document's.

The document's sizes assume a big cluster (8 workers, 4 CPUs each, …). Each setting is tried as
written and, when that does not fit this cluster, also scaled to it, so both outcomes are shown.
A request that cannot be placed is refused after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (10 s here;
Ray's default waits 60 s per try and retries for ever, expecting an autoscaler).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from serverless_gpu.ray import ray_launch

#: How long a trial waits for its placement group before it counts as refused.
START_TIMEOUT_S = "10"


@dataclass
class Trial:
    """One row: a setting of the document, the ScalingConfig (and TorchConfig) that tries it."""

    name: str
    code: str
    scaling: dict[str, Any]
    backend: str | None = None  # TorchConfig(backend=...)
    notes: list[str] = field(default_factory=list)


#: --quick (CI): these settings only, each in the form that shows its point on a small cluster.
QUICK = {"use_gpu": "scaled", "several GPUs per worker": "as written", "accelerator_type": "as written",
         "fractional GPUs": "scaled", "trainer_resources (deprecated)": "as written"}


def plan_trials(gpus: int, cpus: int, model: str | None, iface: str, quick: bool = False) -> list[Trial]:
    """The document's settings, as written and (where they do not fit) scaled to gpus/cpus."""
    trials = [
        Trial("num_workers", "ScalingConfig(num_workers=8)", {"num_workers": 8}),
        Trial("use_gpu", "ScalingConfig(num_workers=8, use_gpu=True)", {"num_workers": 8, "use_gpu": True}),
        Trial("GPU in train_func", "ScalingConfig(num_workers=1, use_gpu=True)", {"num_workers": 1, "use_gpu": True}),
        Trial("several GPUs per worker", 'ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"GPU": 2})',
              {"num_workers": 1, "use_gpu": True, "resources_per_worker": {"GPU": 2}}),
        Trial("accelerator_type", 'ScalingConfig(num_workers=1, use_gpu=True, accelerator_type="A100")',
              {"num_workers": 1, "use_gpu": True, "accelerator_type": "A100"}),
        Trial("TorchConfig backend", 'ScalingConfig(num_workers=8, use_gpu=True) + TorchConfig(backend="gloo")',
              {"num_workers": 8, "use_gpu": True}, backend="gloo"),
        Trial("NCCL_SOCKET_IFNAME", f'ray.init(runtime_env={{"env_vars": {{"NCCL_SOCKET_IFNAME": "{iface}"}}}})',
              {"num_workers": 8, "use_gpu": True}),
        Trial("resources_per_worker", 'ScalingConfig(num_workers=8, resources_per_worker={"CPU": 4, "GPU": 2}, use_gpu=True)',
              {"num_workers": 8, "use_gpu": True, "resources_per_worker": {"CPU": 4, "GPU": 2}}),
        Trial("fractional GPUs", 'ScalingConfig(num_workers=8, resources_per_worker={"CPU": 4, "GPU": 0.5}, use_gpu=True)',
              {"num_workers": 8, "use_gpu": True, "resources_per_worker": {"CPU": 4, "GPU": 0.5}}),
        Trial("trainer_resources (deprecated)",
              'ScalingConfig(num_workers=4, resources_per_worker={"CPU": 2}, trainer_resources={"CPU": 0})',
              {"num_workers": 4, "resources_per_worker": {"CPU": 2}, "trainer_resources": {"CPU": 0}}),
    ]
    planned: list[Trial] = []
    for trial in trials:
        scaled = scale(trial, gpus, cpus, model)
        if quick:
            form = QUICK.get(trial.name)
            if form == "scaled" and scaled is not None:
                planned.append(scaled)
            elif form is not None:
                planned.append(trial)
            continue
        planned.append(trial)
        if scaled is not None:
            planned.append(scaled)
    return planned


def needs(scaling: dict[str, Any]) -> dict[str, float]:
    """Total resources a ScalingConfig asks for (Ray Train's defaults: 1 GPU or 1 CPU per worker)."""
    per = dict(scaling.get("resources_per_worker") or ({"GPU": 1} if scaling.get("use_gpu") else {"CPU": 1}))
    return {k: v * scaling["num_workers"] for k, v in per.items()}


def scale(trial: Trial, gpus: int, cpus: int, model: str | None) -> Trial | None:
    """The same setting sized to this cluster, or None when the document's sizes already fit."""
    s = dict(trial.scaling)
    if "trainer_resources" in s:
        return None  # refused whatever the sizes: the point of the row
    if s.get("accelerator_type"):
        if model and model != s["accelerator_type"]:
            return Trial(trial.name, trial.code.replace(f'"{s["accelerator_type"]}"', f'"{model}"'),
                         {**s, "accelerator_type": model}, trial.backend, ["this cluster's GPU model"])
        return None
    total = needs(s)
    if all(total.get(k, 0) <= have for k, have in (("GPU", gpus), ("CPU", cpus))):
        return None
    per = dict(s.get("resources_per_worker") or {})
    if "GPU" in per and per["GPU"] >= 1:
        workers = max(1, gpus // int(per["GPU"]))
    elif "GPU" in per:
        workers = max(2, min(int(gpus / per["GPU"]), cpus))  # fractional: two workers share a GPU
    elif s.get("use_gpu"):
        workers = max(1, gpus)
    else:
        workers = max(1, min(s["num_workers"], cpus))
    if "CPU" in per:
        per["CPU"] = min(per["CPU"], round(cpus / workers, 2))
    scaled = {**s, "num_workers": workers, **({"resources_per_worker": per} if per else {})}
    if all(needs(scaled).get(k, 0) <= have for k, have in (("GPU", gpus), ("CPU", cpus))) and scaled != s:
        code = f"ScalingConfig({', '.join(f'{k}={v!r}' for k, v in scaled.items())})"
        return Trial(trial.name, code + (f' + TorchConfig(backend="{trial.backend}")' if trial.backend else ""),
                     scaled, trial.backend, ["scaled to this cluster"])
    return None


def probe(config: dict) -> None:
    """The training function of every trial: report where this worker landed and what it was given."""
    import ray.train
    import torch.distributed as dist
    from ray.train.torch import get_device, get_devices

    import ray

    context = ray.train.get_context()
    config["collector"].add.remote({
        "trial": config["trial"],
        "rank": context.get_world_rank(),
        "node": ray.get_runtime_context().get_node_id()[:8],
        "gpu_ids": sorted(str(g) for g in ray.get_gpu_ids()),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "device": str(get_device()),
        "devices": sorted(str(d) for d in get_devices()),
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME", ""),
    })


@ray_launch(gpus=8, gpu_type="H100")
def tour(iface: str, storage: str, quick: bool = False) -> dict[str, Any]:
    """The Ray driver: run every trial on this call's cluster and return the rows of the table."""
    import torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    import ray

    # The document's way to give every training worker NCCL_SOCKET_IFNAME: the job's runtime_env.
    ray.init(runtime_env={"env_vars": {"NCCL_SOCKET_IFNAME": iface}})
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    model = next((k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")), None)
    fake_gpus = gpus > 0 and not torch.cuda.is_available()

    @ray.remote(num_cpus=0)
    class Collector:
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def add(self, row: dict[str, Any]) -> None:
            self.rows.append(row)

        def take(self, trial: int) -> list[dict[str, Any]]:
            return sorted((r for r in self.rows if r["trial"] == trial), key=lambda r: r["rank"])

    collector = Collector.remote()
    rows = []
    for index, trial in enumerate(plan_trials(gpus, cpus, model, iface, quick)):
        wait_until_idle(ray, resources)  # the previous trial's workers release their resources asynchronously
        row: dict[str, Any] = {"name": trial.name, "code": trial.code, "notes": list(trial.notes)}
        backend = trial.backend
        if backend is None and trial.scaling.get("use_gpu") and fake_gpus:
            backend = "gloo"
            row["notes"].append("nccl→gloo (fake GPUs)")
        try:
            scaling = ScalingConfig(**trial.scaling)
            trainer = TorchTrainer(
                probe, train_loop_config={"trial": index, "collector": collector},
                scaling_config=scaling, torch_config=TorchConfig(backend=backend) if backend else None,
                run_config=RunConfig(storage_path=storage, name=f"scaling-tour-{os.getpid()}-{index}",
                                     failure_config=FailureConfig(max_failures=0, controller_failure_limit=0)))
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - the refusal is the row's outcome
            if isinstance(exc, KeyboardInterrupt):
                raise
            row["outcome"] = "refused"
            row["why"] = refusal_reason(exc, trial, gpus, cpus, model)
        else:
            workers = ray.get(collector.take.remote(index))
            row["outcome"] = "scheduled"
            row["workers"] = workers
            row["why"] = describe(workers)
        print(f"[{row['outcome']}] {trial.code}: {row['why']}", flush=True)
        rows.append(row)
    return {"rows": rows, "gpus": gpus, "cpus": cpus, "model": model, "fake_gpus": fake_gpus, "iface": iface}


def wait_until_idle(ray: Any, total: dict[str, float], timeout_s: float = 60.0) -> None:
    """Block until every CPU and GPU of the cluster is free again, so each trial starts on an idle cluster."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0) >= total.get(k, 0) for k in ("CPU", "GPU")):
            return
        time.sleep(0.5)


def refusal_reason(exc: BaseException, trial: Trial, gpus: int, cpus: int, model: str | None) -> str:
    """One line: Ray's own message where it says why, else what the request needed against what there is."""
    text = " ".join(str(exc).split())
    if isinstance(exc, DeprecationWarning) or "trainer_resources" in text:
        return "ScalingConfig() raised: " + text.split(". ")[0][:160]
    want = needs(trial.scaling)
    parts = [f"{v:g} {k}" for k, v in want.items()]
    if trial.scaling.get("accelerator_type"):
        parts.append(f"accelerator_type:{trial.scaling['accelerator_type']}")
    have = f"{gpus} GPU ({model or 'no model'}), {cpus} CPU"
    kind = "no room" if "Timeout" in type(exc).__name__ or "timed out" in text.lower() else type(exc).__name__
    return f"{kind}: needs {' + '.join(parts)}; cluster has {have}"


def describe(workers: list[dict[str, Any]]) -> str:
    """One line per trial: how many workers, their GPU ids, device, backend, NCCL interface."""
    if not workers:
        return "ran, but no worker reported"
    gpu_ids = "/".join(",".join(w["gpu_ids"]) or "-" for w in workers)
    devices = "/".join(",".join(w["devices"]) for w in workers)
    nodes = len({w["node"] for w in workers})
    text = f"{len(workers)} worker(s) on {nodes} node(s); GPU ids {gpu_ids}; devices {devices}; backend {workers[0]['backend']}"
    if workers[0]["nccl_ifname"]:
        text += f"; NCCL_SOCKET_IFNAME={workers[0]['nccl_ifname']}"
    return text


def table(result: dict[str, Any]) -> str:
    """The outcome of every trial, as a plain-text table."""
    header = ("setting", "outcome", "as tried", "what happened")
    lines = [(r["name"] + (f" ({'; '.join(r['notes'])})" if r["notes"] else ""), r["outcome"], r["code"], r["why"])
             for r in result["rows"]]
    widths = [min(max(len(x[i]) for x in [header, *lines]), cap) for i, cap in enumerate((44, 9, 70, 200))]

    def fmt(cells: tuple[str, ...]) -> str:
        return " | ".join(c.ljust(w) if i < 3 else c for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    title = (f"Cluster started by ray_launch: {result['gpus']} GPU "
             f"({result['model'] or 'no model'}{', fake' if result['fake_gpus'] else ''}), {result['cpus']} CPU")
    return "\n".join([title, fmt(header), "-+-".join("-" * w for w in widths), *map(fmt, lines)])


def default_iface() -> str:
    """The document's NIC is ens5; use the interface of this machine that carries its address."""
    import psutil

    names = [name for name, addrs in psutil.net_if_addrs().items() if name != "lo"
             and any(a.family.name == "AF_INET" for a in addrs)]
    return "ens5" if "ens5" in names else (names[0] if names else "lo")


def main() -> int:
    import tempfile

    from air.accelerators import discover

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, help="GPUs for the cluster (default: all of this machine's)")
    parser.add_argument("--gpu-type", help="their model (default: this machine's)")
    parser.add_argument("--remote", action="store_true", help="on the configured `ray` profile's cluster")
    parser.add_argument("--fake-gpus", type=int, metavar="N",
                        help="no GPU here: the node advertises N fake H100 (default 2 without a GPU)")
    parser.add_argument("--iface", default=None, help="NCCL_SOCKET_IFNAME to pass through runtime_env")
    parser.add_argument("--quick", action="store_true",
                        help="CI: 5 settings (GPUs, several per worker, fractional, accelerator type, trainer_resources)")
    args = parser.parse_args()

    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", START_TIMEOUT_S)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if args.remote:
        job = tour.with_overrides(gpus=args.gpus or tour.gpus, gpu_type=args.gpu_type or tour.gpu_type)
    else:
        if args.fake_gpus or not discover().gpus:
            os.environ["AIR_FAKE_GPUS"] = f"{args.fake_gpus or 2}:{args.gpu_type or 'H100'}"  # ranks inherit it
        machine = discover()
        job = tour.with_overrides(num_accelerators=args.gpus or len(machine.gpus),
                                  accelerator_type=args.gpu_type or machine.gpu_model, remote=False)
    with tempfile.TemporaryDirectory(prefix="scaling-tour-") as storage:
        result = job.distributed(args.iface or default_iface(), storage, args.quick)[0]
    print()
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
