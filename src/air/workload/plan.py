"""Dry run first: turning a validated spec into a concrete plan is a pure step.

`make_plan` reads the spec, the code snapshot's file list and the environment cache, and returns what
would run: nodes, accelerators per node, each node's environment (secrets masked), what the snapshot
holds. `air run --dry-run` prints it and creates nothing; `air run` saves it as the run's
`submission.json`, which the supervisor executes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from air.settings import AIR_ACCELERATOR_KIND, AIR_ACCELERATOR_TYPE, AIR_RUN_ID

if TYPE_CHECKING:  # (the spec's pydantic models: not imported by a supervisor, which reads only the plan)
    from air.workload.snapshot import SnapshotPlan
    from air.workload.spec import WorkloadSpec

MASK = "***"


class SweepPlan(TypedDict):
    """A `for_each` sweep as the plan holds it: the children's parameter maps, how many may run at once."""

    items: list[dict[str, object]]
    max_concurrent: int | None


@dataclass
class RunPlan:
    """Everything the supervisor needs to run every attempt; secrets only by reference."""

    experiment: str
    run_name: str
    accelerator: str
    num_accelerators: int
    num_nodes: int
    per_node: int
    command: str
    env_variables: dict[str, str]
    secret_refs: dict[str, str]
    parameters: dict[str, object] | None
    max_retries: int
    timeout_minutes: float | None
    profile: str
    backend: str
    hang_timeout_minutes: float | None = None
    backend_address: str | None = None
    code_root: str | None = None
    code_files: int = 0
    code_bytes: int = 0
    code_key: str | None = None
    code_notes: list[str] = field(default_factory=list)
    git: dict[str, object] | None = None
    dependencies: list[str] | str | None = None
    dependencies_base_dir: str | None = None
    environment_version: str | int | None = None
    base_python: str = sys.executable
    environment_state: str | None = None
    #: `environment.docker_image` ({url, tag_policy, credentials_scope, credentials_key}); the nodes run in it.
    docker_image: dict[str, object] | None = None
    #: The pool it would wait in (config.yaml `pools:`); None: no pools configured (the whole machine).
    pool: str | None = None
    #: `compute.priority_class`: BEST_EFFORT, NORMAL or CRITICAL (orders its pool's queue).
    priority_class: str = "NORMAL"
    #: The `_bases_` files merged into the workload, in merge order (the dry run names them).
    bases: list[str] = field(default_factory=list)
    #: A `for_each` sweep: {"items": [parameter maps], "max_concurrent": N | None}; None: an ordinary run.
    sweep: SweepPlan | None = None
    #: A sweep child's: the parent sweep's MLflow run, which its attempts' runs are nested under.
    mlflow_parent_run_id: str | None = None
    #: A sweep child's: the sweep's air run (set by the sweep's supervisor, never from the workload: a child made
    #: before the sweep's MLflow run existed reads that run's id from the store).
    sweep_run_id: str | None = None
    # Filled at submit, when the run exists:
    run_id: str | None = None
    code_path: str | None = None
    parameters_path: str | None = None
    command_path: str | None = None
    #: The workload's `slurm:` section (sbatch options of a `slurm` profile's jobs); None: none given.
    slurm: dict[str, object] | None = None
    #: The secret store the run's secrets come from (an `air server` user's); None: $AIR_HOME/secrets.json.
    secret_store: str | None = None

    def node_env(self, node_rank: int, *, secrets: dict[str, str] | None = None) -> dict[str, str]:
        """The contract variables of one node (MASTER_ADDR/PORT and device slices come from the backend).

        `secrets=None` masks every secret (for display); the supervisor passes the resolved values.
        """
        env: dict[str, str] = {"NCCL_DEBUG": "WARN", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
        env.update(self.env_variables)
        env.update({name: (secrets[name] if secrets is not None else MASK) for name in self.secret_refs})
        env.update({
            "NUM_NODES": str(self.num_nodes), "NODE_RANK": str(node_rank), "WORLD_SIZE": str(self.num_accelerators),
            "LOCAL_WORLD_SIZE": str(self.per_node), "MLFLOW_SYSTEM_METRICS_NODE_ID": f"node_{node_rank}",
            AIR_ACCELERATOR_KIND: self.accelerator.split("_", 1)[0],
            AIR_ACCELERATOR_TYPE: self.accelerator,
        })
        if self.code_path or self.code_root:
            env["CODE_SOURCE_PATH"] = self.code_path or f"<snapshot of {self.code_root}>"
        if self.parameters is not None:
            env["HYPERPARAMETERS_PATH"] = self.parameters_path or "<run folder>/hyperparameters.yaml"
        if self.run_id:
            env[AIR_RUN_ID] = self.run_id
        return env

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunPlan:
        return cls(**json.loads(text))

    def describe(self) -> dict[str, object]:
        """The dry-run view: what would run where, with secrets masked."""
        nodes = [
            {"node_rank": n, "accelerators": self.per_node, "env": dict(sorted(self.node_env(n).items()))}
            for n in range(self.num_nodes)
        ]
        return {
            **({"bases": self.bases} if self.bases else {}),
            "experiment_name": self.experiment, "mlflow_run_name": self.run_name,
            "profile": self.profile, "backend": self.backend,
            "compute": {"accelerator_type": self.accelerator, "num_accelerators": self.num_accelerators,
                        "num_nodes": self.num_nodes, "accelerators_per_node": self.per_node,
                        **({"pool": self.pool} if self.pool else {}), "priority_class": self.priority_class},
            "command": self.command, "max_retries": self.max_retries, "timeout_minutes": self.timeout_minutes,
            "hang_timeout_minutes": self.hang_timeout_minutes,
            "code_snapshot": None if not self.code_root else {
                "root_path": self.code_root, "files": self.code_files, "bytes": self.code_bytes,
                "content_key": self.code_key, "git": self.git, "notes": self.code_notes},
            **({"docker_image": self.docker_image} if self.docker_image else {}),
            "environment": None if self.dependencies is None else {
                "dependencies": self.dependencies, "base_python": self.base_python, "state": self.environment_state},
            "parameters": self.parameters, "secrets": {k: f"{v} ({MASK})" for k, v in self.secret_refs.items()},
            "nodes": nodes,
            **({"for_each": {"max_concurrent": self.sweep.get("max_concurrent"), "count": len(self.sweep["items"]),
                             "items": self.sweep["items"]}} if self.sweep else {}),
        }


def make_plan(spec: WorkloadSpec, *, profile: str, backend: str, backend_address: str | None = None,
              snapshot_plan: SnapshotPlan | None = None) -> RunPlan:
    """The pure half of a launch. `snapshot_plan` is air.workload.snapshot's SnapshotPlan, when any."""
    from air.config import resolve_base_python

    deps = spec.environment.dependencies
    state = None
    version = spec.environment.version
    parsed = None
    if deps is not None:
        from air.environments import parse_dependencies

        parsed = parse_dependencies(deps, spec.source_dir or Path.cwd())
        version = version if version is not None else parsed.version  # a requirements.yaml's own version
    base_python = str(resolve_base_python(version))
    if parsed is not None:
        from air.environments import cache_state

        state = cache_state(parsed, Path(base_python))
    plan = RunPlan(
        experiment=spec.experiment_name, run_name=spec.run_name, accelerator=spec.accelerator.name,
        num_accelerators=spec.compute.num_accelerators, num_nodes=spec.num_nodes, per_node=spec.per_node,
        command=spec.command, env_variables=dict(spec.env_variables), secret_refs=dict(spec.secrets),
        parameters=spec.parameters, max_retries=spec.max_retries, timeout_minutes=spec.timeout_minutes,
        hang_timeout_minutes=spec.hang_timeout_minutes, profile=profile, backend=backend, backend_address=backend_address,
        dependencies=deps, dependencies_base_dir=str(spec.source_dir or Path.cwd()),
        environment_version=version, base_python=base_python, environment_state=state,
        docker_image=(spec.environment.docker_image.model_dump(exclude_none=True)
                      if spec.environment.docker_image is not None else None),
        bases=[str(b) for b in spec.bases], priority_class=spec.compute.priority_class,
        sweep=({"items": spec.for_each.expand(), "max_concurrent": spec.for_each.max_concurrent}
               if spec.for_each is not None else None),
        slurm=spec.slurm.model_dump(exclude_none=True) if spec.slurm is not None else None,
    )
    if snapshot_plan is not None:
        plan.code_root = str(snapshot_plan.root_path)
        plan.code_files = snapshot_plan.file_count
        plan.code_bytes = snapshot_plan.total_bytes
        plan.code_key = snapshot_plan.key
        plan.code_notes = list(snapshot_plan.notes)
        plan.git = snapshot_plan.git.to_dict() if snapshot_plan.git is not None else None
    return plan
