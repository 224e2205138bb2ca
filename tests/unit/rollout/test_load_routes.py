"""Direct-copy routes: found from names and fused layouts, kept only where the engine's loader agrees."""

import dataclasses

import torch

from rollout.load_routes import Route, bucket_copies, candidate_routes, copy_routed, tied_twins, verified_routes
from rollout.weight_sync import plan_buckets, tensor_metas

HF = {  # a Llama-like layer with grouped k/v (2 query heads per kv head), a GPT-2-like Conv1D, a tied head
    "layers.0.attn.q_proj.weight": torch.randn(4, 3),
    "layers.0.attn.k_proj.weight": torch.randn(2, 3),
    "layers.0.attn.v_proj.weight": torch.randn(2, 3),
    "layers.0.norm.weight": torch.randn(3),
    "layers.0.mlp.c_fc.weight": torch.randn(3, 5),  # Conv1D stores (in, out); the engine wants (out, in)
    "layers.0.mlp.c_proj.weight": torch.randn(3, 3),  # square: only a probe tells it is transposed
    "layers.0.mlp.odd.weight": torch.randn(3, 3),  # a loader that scales: stays with the loader
    "embed.weight": torch.randn(7, 3),
    "lm_head.weight": torch.randn(7, 3),
}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


class Engine:
    """Stands in for a vLLM model: a fused qkv parameter, a transposing loader for Conv1D weights, a
    scaling one, a padded embedding and a head whose weight the loader skips."""

    def __init__(self):
        self.params = {
            "layers.0.attn.qkv_proj.weight": torch.zeros(8, 3),
            "layers.0.norm.weight": torch.zeros(3),
            "layers.0.mlp.c_fc.weight": torch.zeros(5, 3),
            "layers.0.mlp.c_proj.weight": torch.zeros(3, 3),
            "layers.0.mlp.odd.weight": torch.zeros(3, 3),
            "embed.weight": torch.zeros(8, 3),  # vocabulary padded from 7 rows
        }
        self.calls = 0

    def load_weights(self, weights):
        offsets = {"q_proj": 0, "k_proj": 4, "v_proj": 6}
        for name, t in weights:
            self.calls += 1
            shard = name.split(".")[-2]
            if shard in offsets:
                self.params["layers.0.attn.qkv_proj.weight"][offsets[shard] : offsets[shard] + len(t)] = t
            elif shard in ("c_fc", "c_proj"):
                self.params[name].copy_(t.t())
            elif shard == "odd":
                self.params[name].copy_(t * 2)
            elif name in self.params:
                self.params[name][: len(t)].copy_(t)


def test_candidates_from_names_and_fused_layout():
    shapes = {n: tuple(p.shape) for n, p in Engine().params.items()}
    routes = candidate_routes(tensor_metas(HF.items()), shapes, PACKED)
    assert routes == {
        "layers.0.attn.q_proj.weight": Route("layers.0.attn.qkv_proj.weight", 0),
        "layers.0.attn.k_proj.weight": Route("layers.0.attn.qkv_proj.weight", 4),  # after q's 4 rows
        "layers.0.attn.v_proj.weight": Route("layers.0.attn.qkv_proj.weight", 6),
        "layers.0.norm.weight": Route("layers.0.norm.weight", 0),
        "embed.weight": Route("embed.weight", 0),  # its first 7 rows
        "layers.0.mlp.c_fc.weight": Route("layers.0.mlp.c_fc.weight", 0, transposed=True),
        "layers.0.mlp.c_proj.weight": Route("layers.0.mlp.c_proj.weight", 0),  # a guess, until probed
        "layers.0.mlp.odd.weight": Route("layers.0.mlp.odd.weight", 0),
    }  # lm_head: no such parameter


def test_a_probe_rejects_a_route_the_loader_does_not_take():
    engine = Engine()
    metas = tensor_metas(HF.items())
    candidates = candidate_routes(metas, {n: tuple(p.shape) for n, p in engine.params.items()}, PACKED)
    candidates["layers.0.attn.k_proj.weight"] = Route("layers.0.attn.qkv_proj.weight", 5)  # a wrong row
    routes = verified_routes(candidates, metas, engine.params, engine.load_weights, "cpu", chunk_bytes=32)
    assert set(routes) == {
        "layers.0.attn.q_proj.weight",
        "layers.0.attn.v_proj.weight",
        "layers.0.norm.weight",
        "embed.weight",
        "layers.0.mlp.c_fc.weight",
        "layers.0.mlp.c_proj.weight",
    }
    assert routes["layers.0.mlp.c_proj.weight"].transposed  # the probe found it transposed


def test_routed_and_loader_paths_together_give_the_loaders_result():
    reference, engine = Engine(), Engine()
    reference.load_weights(HF.items())
    metas = tensor_metas(HF.items())
    routes = verified_routes(
        candidate_routes(metas, {n: tuple(p.shape) for n, p in engine.params.items()}, PACKED),
        metas,
        engine.params,
        engine.load_weights,
        "cpu",
    )
    engine.calls = 0
    engine.load_weights(copy_routed(HF.items(), routes, engine.params))
    assert engine.calls == 2  # only odd and lm_head went through the loader
    for name, p in reference.params.items():
        assert torch.equal(engine.params[name], p), name


def test_routes_cast_to_the_parameter_dtype():
    params = {"w": torch.zeros(2, 2, dtype=torch.bfloat16)}
    t = torch.tensor([[1.001, 2.0], [3.0, 4.0]])
    routes = verified_routes(
        {"w": Route("w", 0)}, tensor_metas([("w", t)]), params, lambda ws: [params[n].copy_(x) for n, x in ws], "cpu"
    )
    assert list(copy_routed([("w", t)], routes, params)) == []
    assert torch.equal(params["w"], t.to(torch.bfloat16))


def test_a_tied_head_is_dropped_only_when_its_embedding_is_copied():
    m = torch.nn.Module()
    m.embed, m.head = torch.nn.Embedding(7, 3), torch.nn.Linear(3, 7, bias=False)
    m.head.weight = m.embed.weight
    names = {"embed.weight", "head.weight"}
    routes = {"embed.weight": Route("embed.weight", 0)}
    assert tied_twins(routes, names, m) == {"head.weight"}
    assert tied_twins({}, names, m) == frozenset()  # the loader gets both and handles the tie itself
    weights = [("embed.weight", torch.ones(7, 3)), ("head.weight", torch.ones(7, 3))]
    params = dict(m.named_parameters())
    assert list(copy_routed(weights, routes, params, tied_twins(routes, names, m))) == []
    assert torch.equal(m.head.weight, torch.ones(7, 3))


def test_bucket_copies_merge_fused_rows_and_load_what_the_routes_do():
    engine, by_routes = Engine(), Engine()
    names = [
        "layers.0.attn.q_proj.weight",
        "layers.0.attn.k_proj.weight",
        "layers.0.attn.v_proj.weight",
        "layers.0.norm.weight",
        "layers.0.mlp.c_fc.weight",
        "embed.weight",
        "lm_head.weight",
    ]
    routes = {
        n: r
        for n, r in candidate_routes(
            tensor_metas(HF.items()), {n: tuple(p.shape) for n, p in engine.params.items()}, PACKED
        ).items()
        if n in names
    }
    metas = tensor_metas((n, HF[n]) for n in names)
    buckets = plan_buckets(metas, 4 * (24 + 3 + 15))  # q, k, v, norm, c_fc | embed, lm_head
    plan = bucket_copies(buckets, routes, engine.params, twins=frozenset({"lm_head.weight"}))
    # q, k and v are consecutive rows of qkv_proj: one copy of 8 rows; the skipped head copies nothing
    assert [[(c.start, tuple(c.dst.shape), c.transposed) for c in copies] for copies in plan] == [
        [(0, (8, 3), False), (24, (3,), False), (27, (5, 3), True)],
        [(0, (7, 3), False)],
    ]
    for bucket, copies in zip(buckets, plan):
        flat = torch.cat([HF[m.name].reshape(-1) for m in bucket])
        for copy in copies:
            copy.run(flat)
    list(copy_routed(((n, HF[n]) for n in names), routes, by_routes.params, frozenset({"lm_head.weight"})))
    for name, p in by_routes.params.items():
        assert torch.equal(engine.params[name], p), name
    assert torch.equal(engine.params["layers.0.attn.qkv_proj.weight"][4:6], HF["layers.0.attn.k_proj.weight"])
    # c_fc sent in the layout the engine stores: a plain copy, same result
    wire = [[dataclasses.replace(m, transposed=m.name == "layers.0.mlp.c_fc.weight") for m in b] for b in buckets]
    wired = Engine()
    for bucket, copies in zip(wire, bucket_copies(wire, routes, wired.params, frozenset({"lm_head.weight"}))):
        assert not any(c.transposed for c in copies)
        flat = torch.cat([(HF[m.name].t() if m.transposed else HF[m.name]).reshape(-1) for m in bucket])
        for copy in copies:
            copy.run(flat)
    for name, p in by_routes.params.items():
        assert torch.equal(wired.params[name], p), name
    try:
        bucket_copies(buckets, routes, engine.params)  # lm_head neither routed nor a twin
    except KeyError as e:
        assert "lm_head.weight" in str(e)
    else:
        raise AssertionError("an unrouted tensor was accepted")
