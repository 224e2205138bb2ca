"""The payloads relay sends through vLLM's weight-transfer API parse with the engines vLLM builds for
them, and the sender's stream is the one those engines expect: the GPU backends (NCCL, IPC) checked
on CPU against vLLM's own classes, and the backend each placement gets."""

import dataclasses
import importlib

import pytest
import torch
from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine, NCCLWeightTransferEngine

from rollout.engine import transfer_backend
from rollout.weight_sync import (
    BACKENDS,
    GLOO_BACKEND,
    IPC_BACKEND,
    NCCL_BACKEND,
    GroupAddress,
    TensorMeta,
    decode_plan,
    init_info,
    merge_ipc_update_infos,
    plan_buckets,
    tensor_metas,
    update_info,
    wire_tensors,
)

WEIGHTS = {
    "model.embed_tokens.weight": torch.randn(11, 4),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
    "transformer.h.0.attn.c_attn.weight": torch.randn(4, 12),  # GPT-2's Conv1D: engines store it transposed
    "model.norm.weight": torch.randn(4),
}
ADDRESS = GroupAddress("10.0.0.7", 29512, rank_offset=3, world_size=5, timeout_s=42.0, bucket_bytes=1 << 20)


def parsed(engine_cls, method: str, payload: dict):
    """What vLLM's worker hands the engine: engine.parse_init_info / parse_update_info of the dict."""
    engine = object.__new__(engine_cls)  # parsing reads the class's info types only
    return getattr(engine, method)(payload)


def test_each_placement_gets_its_backend_and_vllm_knows_every_one():
    assert transfer_backend(gpu=False, colocated=False) == transfer_backend(gpu=False, colocated=True) == GLOO_BACKEND
    assert transfer_backend(gpu=True, colocated=False) == NCCL_BACKEND == "nccl"
    assert transfer_backend(gpu=True, colocated=True) == IPC_BACKEND == "ipc"
    assert BACKENDS == {GLOO_BACKEND: "cpu", NCCL_BACKEND: "cuda", IPC_BACKEND: "cuda"}
    # the module vLLM's workers import (worker_extension_cls) registers relay's engine, once however often
    ext = importlib.import_module("rollout.vllm_ext")
    importlib.reload(importlib.import_module("rollout.transfer"))
    importlib.reload(ext)
    from rollout.transfer import GlooWeightTransferEngine

    assert WeightTransferEngineFactory._registry[GLOO_BACKEND]().__name__ == GlooWeightTransferEngine.__name__
    assert WeightTransferEngineFactory._registry["nccl"]() is NCCLWeightTransferEngine
    assert WeightTransferEngineFactory._registry["ipc"]() is IPCWeightTransferEngine


def test_nccl_init_info_parses_with_vllms_engine_as_the_sender_expects():
    info = parsed(NCCLWeightTransferEngine, "parse_init_info", init_info(NCCL_BACKEND, ADDRESS))
    assert (info.master_address, info.master_port, info.rank_offset, info.world_size) == ("10.0.0.7", 29512, 3, 5)
    # the packed stream's chunks are cut alike on both ends: the sender's bucket size and buffer count
    assert info.packed and info.packed_buffer_size_bytes == 1 << 20 and info.packed_num_buffers == 2


def test_nccl_update_info_parses_and_the_senders_stream_matches_it_in_vllms_own_check():
    buckets = plan_buckets(tensor_metas(WEIGHTS.items()), 64)
    # transposed marks (relay's gloo wire layout) and a bf16 wire dtype must not leak into NCCL's stream
    buckets = [[dataclasses.replace(m, transposed="c_attn" in m.name, dtype="bfloat16") for m in b] for b in buckets]
    info = parsed(NCCLWeightTransferEngine, "parse_update_info", update_info(NCCL_BACKEND, buckets))
    assert info.names == list(WEIGHTS)
    assert info.shapes == [list(t.shape) for t in WEIGHTS.values()]  # Hugging Face layout
    assert info.dtype_names == ["bfloat16"] * len(WEIGHTS)
    meta = [ParamMeta(n, getattr(torch, d), tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes)]
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(wire_tensors(buckets, WEIGHTS.__getitem__), meta))
    assert [n for n, _ in sent] == list(WEIGHTS)
    assert all(torch.equal(t, WEIGHTS[n].to(torch.bfloat16)) for n, t in sent)
    with pytest.raises(ValueError, match="disagrees"):  # the check is real: a stream out of order fails it
        list(NCCLTrainerWeightTransferEngine._checked_iter(reversed(sent), meta))


def test_ipc_payloads_parse_with_vllms_engine_and_merge_every_gpus_handles():
    assert parsed(IPCWeightTransferEngine, "parse_init_info", init_info(IPC_BACKEND, ADDRESS)).packed is False
    # what ipc_update_info makes on each learner rank's GPU (handles stand in: no GPU here)
    names, shapes = list(WEIGHTS), [list(t.shape) for t in WEIGHTS.values()]
    ranks = [
        {
            "names": names,
            "dtype_names": ["float32"] * 4,
            "shapes": shapes,
            "ipc_handles": [{f"gpu{r}": (n,)} for n in names],
        }
        for r in range(2)
    ]
    info = parsed(IPCWeightTransferEngine, "parse_update_info", merge_ipc_update_infos(ranks))
    assert info.names == names and info.shapes == shapes
    assert info.ipc_handles == [{"gpu0": (n,), "gpu1": (n,)} for n in names]
    assert ranks[0]["ipc_handles"][0] == {"gpu0": (names[0],)}  # the ranks' own payloads untouched


def test_gloo_payloads_parse_with_relays_engine():
    from rollout.transfer import GlooWeightTransferEngine

    init = parsed(GlooWeightTransferEngine, "parse_init_info", init_info(GLOO_BACKEND, ADDRESS))
    assert (init.host, init.port, init.rank_offset, init.world_size, init.timeout_s) == ("10.0.0.7", 29512, 3, 5, 42.0)
    buckets = plan_buckets(tensor_metas(WEIGHTS.items()), 64)
    update = parsed(
        GlooWeightTransferEngine, "parse_update_info", update_info(GLOO_BACKEND, buckets) | {"direct": False}
    )
    assert decode_plan(update.plan) == buckets and update.payload == b"" and update.direct is False
    with pytest.raises(ValueError, match="Invalid update_info"):
        parsed(GlooWeightTransferEngine, "parse_update_info", {"names": ["x"]})  # another backend's payload
    with pytest.raises(ValueError, match="no broadcast plan"):
        update_info(IPC_BACKEND, [[TensorMeta("x", (1,), "float32")]])
