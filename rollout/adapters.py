"""LoRA adapters on an engine (learner.lora.sync adapter). The engine holds the base weights, loaded once at
start, and never takes merged ones. Each sync's adapter (its tensors and config, as PEFT saves them) is written
to a folder of the engine's own and loaded by vLLM under a new id (AsyncLLM.add_lora, vLLM's path-based
LoRARequest); requests added from then on sample with it, and an older one is removed once no request samples
with it any more."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import tempfile
from collections import Counter
from pathlib import Path

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (vllm.config.lora)
LORA_SLOTS = 2  # adapters in the engine's LoRA slots at once: the newest, and one requests in flight still use
CACHED = 4  # adapters vLLM keeps loaded (max_cpu_loras): one evicted from a slot reloads from memory


def slot_rank(rank: int) -> int:
    """The rank of vLLM's LoRA slots that hold adapters of `rank`: the next of its max_lora_rank choices."""
    slot = next((r for r in MAX_LORA_RANKS if r >= rank), None)
    if slot is None:
        raise ValueError(f"learner.lora.rank {rank}: vLLM serves adapters up to rank {MAX_LORA_RANKS[-1]}")
    return slot


def engine_lora_args(rank: int) -> dict:
    """vLLM engine arguments for adapters of `rank` (0: no LoRA)."""
    if rank <= 0:
        return {}
    return {"enable_lora": True, "max_lora_rank": slot_rank(rank), "max_loras": LORA_SLOTS, "max_cpu_loras": CACHED}


def refuse_unservable(model_path: str, targets: list[str]) -> None:
    """ValueError, naming learner.lora.sync, where vLLM cannot serve the adapter: an architecture vLLM has no
    LoRA for (its registry's SupportsLoRA), or adapters on the embeddings or the LM head."""
    config = Path(model_path) / "config.json"
    arch = (json.loads(config.read_text()).get("architectures") or ["?"])[0] if config.exists() else "?"
    from vllm.model_executor.models import ModelRegistry, supports_lora

    model = ModelRegistry._try_load_model_cls(arch)  # None: an architecture vLLM does not know
    if model is None or not supports_lora(model):
        raise ValueError(
            f"learner.lora.sync adapter: vLLM serves no LoRA adapter for {arch} ({model_path}); set "
            "learner.lora.sync=merged, which sends the weights with the adapter merged in at every sync"
        )
    outside = sorted({"lm_head", "embed_tokens", "wte", "wpe"} & set(targets))
    if outside:
        raise ValueError(
            f"learner.lora.sync adapter: vLLM's LoRA serves adapters on linear layers, not on {outside} "
            "(learner.lora.target_modules); set learner.lora.sync=merged"
        )


def adapter_bytes(adapter: dict) -> int:
    return sum(t.numel() * t.element_size() for t in adapter["tensors"].values())


def write_adapter(folder: Path, adapter: dict) -> None:
    """The adapter as PEFT saves one: adapter_model.safetensors and adapter_config.json (what vLLM loads)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(adapter["tensors"], str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(adapter["config"]))


ADAPTER_DIRS = "relay-adapters-"  # + host + "." + the engine process's pid + "-" + a random part


def owner() -> str:
    """This engine's part of its folders' names: its host (a shared temporary directory holds other nodes') and pid."""
    return f"{socket.gethostname().replace('-', '_')}.{os.getpid()}"


def sweep_dead(tmp: Path) -> list[Path]:
    """Remove the adapter folders of engine processes on this host that are gone (their pid in the name); those of
    live ones, and of other hosts, stay. Returns those removed."""
    removed, host = [], owner().rpartition(".")[0]
    for folder in tmp.glob(f"{ADAPTER_DIRS}{host}.*-*"):
        pid = folder.name.removeprefix(f"{ADAPTER_DIRS}{host}.").partition("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class Adapters:
    """Owns an engine's adapters: their folders and ids, the newest (`current`, None before the first sync:
    the base model), the policy version each carries and how many requests sample with each."""

    def __init__(self, llm):
        self.llm = llm
        sweep_dead(Path(tempfile.gettempdir()))  # engines that died without close() left theirs
        self.root = Path(tempfile.mkdtemp(prefix=f"{ADAPTER_DIRS}{owner()}-"))
        self.ids = itertools.count(1)  # vLLM's lora_int_id: > 0, and new for every load
        self.current = None
        self.version: dict[int, int] = {}  # adapter id -> the policy version it carries
        self.users: Counter[int] = Counter()  # adapter id -> requests sampling with it

    async def load(self, adapter: dict, version: int) -> None:
        """Load `adapter` as policy `version`; requests added from now on sample with it."""
        from vllm.lora.request import LoRARequest

        lid = next(self.ids)
        folder = self.root / str(lid)
        write_adapter(folder, adapter)
        request = LoRARequest(f"relay-policy-{lid}", lid, str(folder))
        if not await self.llm.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of policy version {version} ({folder})")
        old, self.current = self.current, request
        self.version[lid] = version
        if old is not None:
            await self._drop_if_unused(old)

    def take(self):
        """The adapter a request added now samples with (None: the base model), counted as one of its users."""
        if self.current is not None:
            self.users[self.current.lora_int_id] += 1
        return self.current

    async def release(self, request) -> None:
        """A request that sampled with `request` ended."""
        if request is not None:
            self.users[request.lora_int_id] -= 1
            await self._drop_if_unused(request)

    async def _drop_if_unused(self, request) -> None:
        lid = request.lora_int_id
        if request is self.current or self.users[lid] > 0:
            return
        del self.users[lid], self.version[lid]
        await self.llm.remove_lora(lid)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def loaded(self) -> list[int]:
        """The policy versions of the adapters loaded now, oldest first."""
        return [self.version[lid] for lid in sorted(self.version)]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
