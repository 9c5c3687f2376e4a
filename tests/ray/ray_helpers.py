"""Helpers shared by the Ray tests (a unique module name: test folders are not packages)."""

from __future__ import annotations


def never() -> bool:
    return False


#: Seed 000's command, unchanged but for CPUs (no GPUs here) and a small object store.
SEED_000_COMMAND = r"""
set -euo pipefail
RAY_HEAD_PORT=6379
if [ "${NODE_RANK:-0}" = "0" ]; then
  ray start --head --port=$RAY_HEAD_PORT --num-cpus=1 --object-store-memory=80000000 --include-dashboard=false
  python - <<'PY'
import time, ray
ray.init(address="auto")
deadline = time.time() + 90
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
    time.sleep(0.5)
print("alive nodes:", len([n for n in ray.nodes() if n["Alive"]]), "gcs:", ray.get_runtime_context().gcs_address)
PY
  ray stop
else
  for i in $(seq 1 12); do
    if ray start --address="$MASTER_ADDR:$RAY_HEAD_PORT" --num-cpus=1 --object-store-memory=80000000 --block 2>/dev/null; then
      break
    fi
    echo "Attempt $i failed, retrying in 5s..."
    sleep 5
  done
fi
"""
