"""The Ray backend's view of the cluster: joining it as a driver, and what its alive nodes can hold
(a node's bundle, whether a shape can ever fit, how a bare model packs into nodes, why a run waits).

`RayCapacity` is the base of `RayBackend` (ray_backend.py); it reads the cluster and holds nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TypedDict

from air.accelerators import AcceleratorType, normalize_model
from air.backends.base import parse_node_shape
from air.backends.ray_cluster import refresh_auth
from air.errors import BackendUnavailableError, GPUValidationError

_log = logging.getLogger("air.backends.ray")

#: Ray's share of a node's accelerator-type resource per bundle, as Ray Train asks for it.
ACCELERATOR_SHARE = 0.001


class RayNode(TypedDict, total=False):
    """One entry of `ray.nodes()`: the keys air reads."""

    NodeID: str
    Alive: bool
    NodeManagerAddress: str
    NodeManagerPort: int
    Resources: dict[str, float]
    Labels: dict[str, str]


def import_ray() -> ModuleType:
    import ray

    return ray


class RayCapacity:
    """Connection and capacity half of `RayBackend`; `RayBackend.__init__` sets the attributes below."""

    address: str
    namespace: str

    # -- connection -------------------------------------------------------------------------------

    def connect(self) -> None:
        """Join the cluster as a driver (once per process); clear errors for the usual mistakes."""
        if not self.address:
            raise BackendUnavailableError(
                "The ray profile has no address (and RAY_ADDRESS is not set).",
                hint="Set profiles.NAME.address in $AIR_HOME/config.yaml to the cluster's GCS address (host:port). "
                "air does not guess: on a shared machine 'auto' may find someone else's cluster.",
            )
        ray = import_ray()
        if ray.is_initialized():
            self._check_same_cluster(ray)
            return
        if self.address.startswith("ray://"):
            raise BackendUnavailableError(
                f"The ray profile's address {self.address!r} is a Ray Client address; air needs the cluster's "
                "GCS address.",
                hint="Use the address `ray start --head` printed (host:6379 or the port you chose).",
            )
        refresh_auth()
        _log.info("connecting to the Ray cluster at %s (namespace %s)", self.address, self.namespace)
        started = time.monotonic()
        try:
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                     logging_level=logging.WARNING)
            _log.info("connected to the Ray cluster at %s in %.1f s", self.address, time.monotonic() - started)
        except Exception as exc:  # ConnectionError, AuthenticationError, …
            text = f"{type(exc).__name__}: {exc}"
            auth = "auth" in text.lower() or "token" in text.lower()
            raise BackendUnavailableError(
                f"Cannot connect to the Ray cluster at {self.address}: {text.splitlines()[0][:400]}",
                hint="Set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, "
                "or RAY_AUTH_MODE=disabled for a cluster started without authentication."
                if auth else "Check the profile's address (`air -h config.profiles`) and that the cluster is up "
                "(`ray status --address ...`).",
            ) from None

    def _check_same_cluster(self, ray: ModuleType) -> None:
        """One process drives one Ray cluster: refuse to silently use another one."""
        try:
            current = ray.get_runtime_context().gcs_address
        except Exception:
            return
        if self.address == "auto" or not current:
            return
        if current.rsplit(":", 1)[-1] != self.address.rsplit(":", 1)[-1]:
            raise BackendUnavailableError(
                f"This process is already connected to the Ray cluster at {current}, not {self.address}.",
                hint="Use one Ray cluster per process (call ray.shutdown() first, or run from a fresh process).",
            )

    # -- capacity ---------------------------------------------------------------------------------

    def _alive_nodes(self) -> list[RayNode]:
        self.connect()
        return [n for n in import_ray().nodes() if n.get("Alive")]

    @staticmethod
    def _node_address(node: RayNode) -> str:
        return f"{node.get('NodeManagerAddress')}:{node.get('NodeManagerPort')}"

    def _accelerator_key(self, model: str, nodes: Sequence[RayNode]) -> str | None:
        """The cluster's resource name for a GPU model (Ray says A10G where air says A10)."""
        counts: dict[str, int] = {}
        for node in nodes:
            for key in node.get("Resources", {}):
                if key.startswith("accelerator_type:"):
                    name = key.split(":", 1)[1]
                    if name.upper() == model.upper() or normalize_model(name) == model:
                        counts[key] = counts.get(key, 0) + 1
        return max(counts, key=lambda k: counts[k]) if counts else None

    def bundle_for(self, accelerator: AcceleratorType, nodes: Sequence[RayNode] | None = None
                   ) -> dict[str, float]:
        """One node's bundle: its CPU slots, or its GPUs plus a sliver of the accelerator type."""
        if accelerator.is_cpu:
            return {"CPU": float(accelerator.per_node)}
        nodes = nodes if nodes is not None else self._alive_nodes()
        key = self._accelerator_key(accelerator.model, nodes) or f"accelerator_type:{accelerator.model}"
        return {"GPU": float(accelerator.per_node), key: ACCELERATOR_SHARE}

    def describe_capacity(self) -> str:
        nodes = self._alive_nodes()
        cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
        gpus: dict[str, float] = {}
        for node in nodes:
            count = node["Resources"].get("GPU", 0)
            if count:
                models = [k.split(":", 1)[1] for k in node["Resources"] if k.startswith("accelerator_type:")]
                model = models[0] if models else "GPU"
                gpus[model] = gpus.get(model, 0) + count
        gpu_text = ", ".join(f"{g:g} × {m}" for m, g in sorted(gpus.items())) or "no GPU"
        return f"Ray cluster at {self.address}: {len(nodes)} nodes, {gpu_text}, {cpus:g} CPUs"

    def _nodes_fitting(self, bundle: Mapping[str, float], nodes: Sequence[RayNode],
                       resources_of: Callable[[RayNode], Mapping[str, float]]) -> int:
        return sum(1 for n in nodes if all(resources_of(n).get(k, 0) >= v for k, v in bundle.items()))

    def check_shape(self, accelerator: AcceleratorType, num_nodes: int) -> None:
        nodes = self._alive_nodes()
        bundle = self.bundle_for(accelerator, nodes)
        fit = self._nodes_fitting(bundle, nodes, lambda n: n.get("Resources", {}))
        if fit >= num_nodes:
            return
        per_node = f"{accelerator.per_node} × {accelerator.model} GPU" if not accelerator.is_cpu \
            else f"{accelerator.per_node} CPU"
        raise GPUValidationError(
            f"{num_nodes} node(s) of {accelerator.name} need {num_nodes} distinct Ray nodes with {per_node} "
            f"each; {fit} node(s) of the cluster can ever hold that. {self.describe_capacity()}.",
            hint="Ask for fewer nodes or another accelerator type, or add nodes to the cluster "
            "(`ray start --address ... --num-gpus N --resources '{\"accelerator_type:MODEL\": 1}'`).",
        )

    def plan_shape(self, count: int, accelerator_type: str) -> tuple[AcceleratorType, int]:
        """A full node type fixes the ranks per node. A bare model (`H100`, `CPU`, `GPU`) packs as many
        ranks per node as the cluster's nodes hold, using as few nodes as possible."""
        full = parse_node_shape(accelerator_type)
        if full is not None:
            return full, full.nodes_for(count)
        raw = accelerator_type.strip()
        nodes = self._alive_nodes()
        if raw.lower() == "cpu":
            model = "CPU"
            capacities = [int(n["Resources"].get("CPU", 0)) for n in nodes]
        else:
            wanted = None if raw.lower() == "gpu" else (normalize_model(raw) or raw.upper())
            capacities = []
            model = wanted or ""
            for node in nodes:
                types = [k.split(":", 1)[1] for k in node["Resources"] if k.startswith("accelerator_type:")]
                names = {normalize_model(t) or t for t in types}
                if wanted is None and names:
                    model = model or sorted(names)[0]
                if (wanted is None and model in names) or (wanted is not None and wanted in names):
                    capacities.append(int(node["Resources"].get("GPU", 0)))
            if not model:
                raise GPUValidationError(f"Asked for GPUs, but {self.describe_capacity()}.",
                                         hint="Pass accelerator_type='CPU' to run CPU ranks.")
        for per_node in range(min(count, max(capacities, default=0)), 0, -1):
            if count % per_node == 0 and sum(1 for c in capacities if c >= per_node) >= count // per_node:
                kind = "CPU" if model == "CPU" else "GPU"
                return AcceleratorType(kind, per_node, model), count // per_node
        raise GPUValidationError(
            f"{count} × {raw} ranks do not fit on the cluster: {self.describe_capacity()}.",
            hint="Ask for fewer, or give a node shape such as GPU_8xH100 / CPU_2xCPU explicitly.",
        )

    def labelled_usage(self, labels: Mapping[str, str], kind: str) -> tuple[int, int, list[str]]:
        """(total, in use, GPU models) of `kind` ('GPU'/'CPU') on the alive nodes whose labels include
        `labels`: what `air get pools` shows for a pool of Ray nodes."""
        from ray._private.state import available_resources_per_node

        nodes = [n for n in self._alive_nodes()
                 if all((n.get("Labels") or {}).get(k) == v for k, v in labels.items())]
        free = available_resources_per_node()
        total = used = 0.0
        models: set[str] = set()
        for node in nodes:
            have = float(node.get("Resources", {}).get(kind, 0))
            total += have
            used += have - float(free.get(node.get("NodeID", ""), {}).get(kind, 0))
            models |= {k.split(":", 1)[1] for k in node.get("Resources", {}) if k.startswith("accelerator_type:")}
        return int(total), int(round(used)), sorted(models) if kind == "GPU" else []

    def _waiting_line(self, bundle: Mapping[str, float], num_nodes: int) -> str:
        try:
            from ray._private.state import available_resources_per_node

            free = available_resources_per_node()
            room = sum(1 for res in free.values() if all(res.get(k, 0) >= v for k, v in bundle.items()))
        except Exception:  # an internal API: the message is a courtesy
            room = -1
        want = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
        room_text = f"{room} node(s) have room now" if room >= 0 else "the cluster is busy"
        return f"waiting for capacity: {num_nodes} Ray node(s) with {{{want}}} each; {room_text}"

