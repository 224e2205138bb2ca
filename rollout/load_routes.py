"""Direct copies of received tensors into vLLM's parameters, found once and checked by vLLM's own loader.

vLLM's `load_weights` maps each Hugging Face tensor onto a parameter, or onto rows of a fused one
(q/k/v -> qkv_proj, gate/up -> gate_up_proj), through per-tensor Python dispatch: ~4 ms for a 1M
model, most of what a small sync costs beyond the wire. A `Route` records that mapping as
(parameter, first row, transposed), so later syncs copy straight into place. A route is trusted
only after a random probe loaded through `load_weights` was found there verbatim (or transposed, as
GPT-2's Conv1D weights are); a tensor the loader transforms otherwise (a tensor-parallel shard, a
tied head it skips) keeps going through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from rollout.weight_sync import TensorMeta, plan_buckets

Weights = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Route:
    """Where one received tensor goes in the engine: its parameter, its first row there, its layout."""

    param: str  # the engine's parameter name
    row: int  # where the tensor starts along dim 0 inside that parameter
    transposed: bool = False  # the engine stores it transposed (GPT-2's Conv1D weights)


def candidate_routes(
    metas: list[TensorMeta], param_shapes: dict[str, tuple[int, ...]], packed: dict[str, list[str]]
) -> dict[str, Route]:
    """Where each tensor would land if loading were a plain copy: the parameter of the same name (or
    its first rows, if the engine padded it; or its transpose), or its rows inside a fused parameter
    whose shards are stacked in the order `packed` lists them (vLLM's `packed_modules_mapping`,
    e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})."""
    shapes = {m.name: m.shape for m in metas}
    routes = {}
    for m in metas:
        if not m.torch_dtype.is_floating_point:  # probes are random floats
            continue
        own = param_shapes.get(m.name)
        if own == m.shape or (own and m.shape and own[1:] == m.shape[1:] and own[0] >= m.shape[0]):
            routes[m.name] = Route(m.name, 0)  # or its first rows: an embedding padded to a multiple of 64
            continue
        if own and len(m.shape) == 2 and own == m.shape[::-1]:
            routes[m.name] = Route(m.name, 0, transposed=True)
            continue
        module, _, leaf = m.name.rpartition(".")  # "model.layers.0.self_attn.k_proj", "weight"
        parent, _, shard = module.rpartition(".")
        for fused, shards in packed.items():
            if shard not in shards or not m.shape:
                continue
            before = [shapes.get(f"{parent}.{s}.{leaf}") for s in shards[: shards.index(shard)]]
            target = f"{parent}.{fused}.{leaf}"
            fused_shape = param_shapes.get(target)
            if None in before or fused_shape is None or fused_shape[1:] != m.shape[1:]:
                break
            row = sum(s[0] for s in before)
            if row + m.shape[0] <= fused_shape[0]:
                routes[m.name] = Route(target, row)
            break
    return routes


def verified_routes(
    candidates: dict[str, Route],
    metas: list[TensorMeta],
    params: dict[str, torch.Tensor],
    load: Callable[[Weights], object],
    device: str,
    chunk_bytes: int = 64 << 20,
) -> dict[str, Route]:
    """The candidates where a random probe, loaded by `load` (the engine's load_weights), lands
    verbatim; a square matrix may turn out to land transposed instead. Probes go in chunks of
    chunk_bytes, the most extra memory this takes. They overwrite the weights: call this just
    before a full load."""
    g = torch.Generator(device=device).manual_seed(0)
    verified = {}
    for bucket in plan_buckets(metas, chunk_bytes):
        probes = [
            (m.name, torch.randn(m.shape, generator=g, dtype=m.torch_dtype, device=device))
            for m in bucket
            if m.name in candidates
        ]
        load(iter(probes))
        for name, probe in probes:
            route = candidates[name]
            square = probe.dim() == 2 and probe.shape[0] == probe.shape[1]
            for r in (route, Route(route.param, route.row, not route.transposed)) if square else (route,):
                dst, src = _place(params, r, probe)
                if dst.shape == src.shape and torch.equal(dst, src.to(dst.dtype)):
                    verified[name] = r
                    break
    return verified


def tied_twins(routes: dict[str, Route], names: set[str], module: torch.nn.Module) -> frozenset[str]:
    """Names among `names` that are a second name of a routed parameter (a head tied to the
    embedding). The engine's loader skips such a tensor, and refuses to when its twin does not pass
    through it too: with the twin copied directly, it must not reach the loader at all."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    routed = {r.param for r in routes.values()}
    return frozenset(
        n
        for n, p in module.named_parameters(remove_duplicate=False)
        if n in names and canonical[id(p)] != n and canonical[id(p)] in routed
    )


def copy_routed(
    weights: Weights, routes: dict[str, Route], params: dict[str, torch.Tensor], twins: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Copy every routed tensor into place as it arrives, drop tied twins, and yield the others for
    the engine's loader. Copies happen before the next tensor is drawn, so received buffers may be
    reused after."""
    for name, tensor in weights:
        route = routes.get(name)
        if route is not None:
            dst, src = _place(params, route, tensor)
            dst.copy_(src)
        elif name not in twins:
            yield name, tensor


@dataclass(frozen=True)
class Copy:
    """One copy out of a received bucket: as many values as `dst` holds, from `start` of the bucket's
    flat buffer, into `dst`, a view of an engine parameter (they arrive as its transpose if
    `transposed`)."""

    dst: torch.Tensor
    start: int
    transposed: bool

    def run(self, flat: torch.Tensor) -> None:
        src = flat[self.start : self.start + self.dst.numel()]
        self.dst.copy_(src.view(self.dst.shape[::-1]).t() if self.transposed else src.view(self.dst.shape))


def bucket_copies(
    buckets: list[list[TensorMeta]],
    routes: dict[str, Route],
    params: dict[str, torch.Tensor],
    twins: frozenset[str] = frozenset(),
) -> list[list[Copy]]:
    """The copies that load each bucket, every tensor of which is routed or a tied twin (skipped):
    the per-sync loop with its views made once, and consecutive rows of one parameter merged into
    one copy (q, k and v into qkv_proj, as they arrive). 0.3 ms less of a 1M sync than a lookup and
    copy per tensor."""
    plan = []
    for bucket in buckets:
        runs: list[list] = []  # [route, shape (rows of merged tensors summed), start, transposed on copy]
        start, extends = 0, False  # extends: the next tensor may join the last run
        for m in bucket:
            r = routes.get(m.name)
            if r is None and m.name not in twins:
                raise KeyError(f"weight sync: {m.name} has no direct-copy route")
            plain = r is not None and not r.transposed and not m.transposed  # rows arrive as stored
            last = runs[-1] if extends else None
            if plain and last and last[0].param == r.param and last[0].row + last[1][0] == r.row:
                last[1] = (last[1][0] + m.shape[0], *last[1][1:])
            elif r is not None:
                # transposed on copy only if it did not travel in the stored layout already
                runs.append([r, m.shape, start, r.transposed != m.transposed])
            extends = plain and bool(m.shape)
            start += m.numel
        plan.append([Copy(_dst(params, r, shape), first, transposed) for r, shape, first, transposed in runs])
    return plan


def _dst(params: dict[str, torch.Tensor], route: Route, shape: tuple[int, ...]) -> torch.Tensor:
    """The view of the route's parameter that receives a tensor of (Hugging Face) `shape`, in the
    layout the parameter stores: the whole parameter, or rows of it (padded or fused)."""
    stored = tuple(shape[::-1]) if route.transposed else tuple(shape)
    data = params[route.param].data
    return data if data.shape == stored else data.narrow(0, route.row, stored[0])


def _place(params: dict[str, torch.Tensor], route: Route, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the view of the parameter that receives `tensor`, the tensor in that view's layout). The
    source is the one transposed: strided reads copy faster than strided writes."""
    return _dst(params, route, tensor.shape), tensor.t() if route.transposed else tensor
