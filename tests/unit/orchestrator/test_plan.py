"""`relay plan`: the memory arithmetic against hand-computed values, every preset, and the learner
figure against the peak torch allocates in real optimizer steps on CPU."""

import json
from pathlib import Path

import pytest
import torch

from orchestrator.cli import main
from orchestrator.config.load import ConfigError, load_config
from orchestrator.tools import plan_model as P
from orchestrator.tools.plan_devices import plan_train
from orchestrator.tools.plan_roles import total
from tests.helpers import REPO

PRESETS = sorted((REPO / "configs").glob("*.yaml"))
LLAMA_8B = P.KNOWN[1][1]


def test_zero_stages_on_a_1b_model_over_4_ranks():
    # either dtype: float32 master weights 4 B, gradients 4 B, AdamW 2 moments 8 B per param
    # (bfloat16 is autocast: it changes activations, not states)
    n = 10**9
    by_stage = {s: P.training_states(n, n, "bfloat16", s, 4) for s in range(4)}
    assert by_stage[0] == {"weights": 4e9, "gradients": 4e9, "optimizer": 8e9}
    assert by_stage[1] == {"weights": 4e9, "gradients": 4e9, "optimizer": 2e9}  # optimizer / 4
    assert by_stage[2] == {"weights": 4e9, "gradients": 1e9, "optimizer": 2e9}  # + gradients / 4
    assert by_stage[3] == {"weights": 1e9, "gradients": 1e9, "optimizer": 2e9}  # + weights / 4
    assert P.training_states(n, n, "float32", 0, 4) == by_stage[0]
    # LoRA: 1B frozen weights, 10M trained
    assert P.training_states(n, 10**7, "bfloat16", 0, 1) == {"weights": 4e9, "gradients": 4e7, "optimizer": 8e7}


def test_lora_adapter_count_by_hand():
    # hidden 64, 4 heads of 16, 2 kv heads -> k/v out 32; rank 8: q,o 8*(64+64)=1024, k,v 8*(64+32)=768
    s = P.ModelShape("llama", 2, 64, 4, 2, 128, 100, True)
    assert P.lora_params(s, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 2 * (1024 + 768 + 768 + 1024)
    with pytest.raises(ConfigError, match="learner.lora.target_modules"):
        P.lora_params(s, 8, ["qkv"])


def test_lora_count_matches_peft():
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.lora_config import LoraConfig
    from learner.models import add_lora

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    lm = add_lora(LlamaForCausalLM(config), LoraConfig(rank=8))
    trained = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    assert P.lora_params(P.shape_from_hf(config.to_dict()), 8, ["q_proj", "k_proj", "v_proj", "o_proj"]) == trained


def test_kv_bytes_per_token_by_hand():
    # Llama-3-8B: 2 (K, V) x 32 layers x 8 kv heads x 128 head dim x 2 B (bf16) = 131,072 B
    assert P.kv_bytes_per_token(LLAMA_8B, "bfloat16") == 131072
    assert P.kv_bytes_per_token(LLAMA_8B, "bfloat16", tensor_parallel=2) == 65536  # kv heads split


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama_untied", "qwen2"])
def test_param_count_matches_transformers(arch):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    llama = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = {
        "gpt2": GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=3, n_head=4),
        "llama": LlamaConfig(**llama, tie_word_embeddings=True),
        "llama_untied": LlamaConfig(**llama, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**llama, tie_word_embeddings=True),
    }[arch]
    model = AutoModelForCausalLM.from_config(config)
    assert P.param_count(P.shape_from_hf(config.to_dict())) == sum(p.numel() for p in model.parameters())


def test_known_tiny_gpt_vocab_is_relays_char_tokenizer():
    from learner.tiny_gpt import char_tokenizer

    assert P.KNOWN[-1][1].vocab == len(char_tokenizer())


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_plan_runs_on_every_preset(preset, capsys):
    rc = main(["plan", str(preset)])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    assert "learner rank" in out and "weights" in out and "activations" in out
    assert out.rstrip().endswith("verdict: fits" if rc == 0 else "verdict: does not fit")


def _rows(out: str) -> dict[str, str]:
    """label -> value of `relay plan`'s lines, the first of each (the learner's "total" before the others)."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("  ") and " = " not in line:
            rows.setdefault(line[:28].strip(), line[28:40].strip())
    return rows


def _devices(out: str) -> dict[str, str]:
    """device name -> peak, from the lines after "devices (peak, limit):"."""
    lines = out.split("devices (peak, limit):\n")[1].splitlines()
    return {line[:60].strip(): line[60:72].strip() for line in lines if line.startswith("  ")}


def test_chunk_len_follows_chunk_spans():
    from runtime.logprobs import chunk_spans

    for b, t, chunk in [(8, 128, 256), (8, 128, 1024), (2, 2048, 1024), (16, 1536, 1024), (3, 100, 1024), (4, 50, 7)]:
        biggest = max(
            (r.stop - r.start if r.stop <= b else b - r.start) * (min(p.stop, t) - p.start)
            for r, p in chunk_spans(b, t, chunk)
        )
        assert P.chunk_len(b, t, chunk) == biggest, (b, t, chunk)


def test_ppo_llama_8b_on_80gb_by_hand(capsys):
    assert main(["plan", str(REPO / "configs/ppo_llama-8b_multinode_gpu.yaml")]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "built-in table (llama-3.1-8b)" in out and "8.030B params" in out
    rows = _rows(out)
    # policy 8.03B params, ZeRO-3 over 16 ranks, bf16 on GPUs: learner.precision auto -> master_weights (bf16
    # weights, float32 masters): weights 8.03e9 x 2 B / 16 = 1.00 GB, masters and float32 gradient sums
    # 8.03e9 x 4 B / 16 = 2.01 GB each, AdamW 2 moments 8 B x 8.03e9 / 16 = 4.02 GB;
    # one gathered layer 218M x 2 B = 0.44 GB
    assert "learner.precision auto -> master_weights" in out
    assert rows["policy weights"] == "1.00 GB" and rows["policy master weights"] == "2.01 GB"
    assert rows["policy gradients"] == "2.01 GB"
    assert rows["policy optimizer"] == "4.02 GB" and rows["policy gathered layer"] == "0.44 GB"
    # critic from the RM: 8.03B - 0.525B LM head = 7.505B: 2 B / 16 = 0.94 GB, 4 B / 16 = 1.88 GB, 8 B / 16 = 3.75 GB
    assert rows["critic weights"] == "0.94 GB" and rows["critic master weights"] == "1.88 GB"
    assert rows["critic optimizer"] == "3.75 GB"
    # logits (chunked): bf16 2 x 2048 x 128256 x 2 B = 1.05 GB, and its gradient 1.05 GB; 2048 tokens > 1024:
    # chunks of 1024 tokens, 2 float32 temporaries (entropy_coef 0) 2 x 1024 x 128256 x 4 B = 1.05 GB -> 3.15 GB
    assert rows["policy logits"] == "3.15 GB"
    # checkpointed: 2 x 2048 x (32 x 4096 + 8 x 4096 + 5 x 14336 + 2 x 4096) x 2 B = 2.00 GB
    # ZeRO-3's gradient bucket, each model: 5e8 elements of float32 (DeepSpeed fills it in communication_data_type,
    # fp32 under master weights) = 2.00 GB, no other copy
    assert rows["policy reduce bucket"] == "2.00 GB" and rows["critic reduce bucket"] == "2.00 GB"
    assert "policy reduce copy" not in rows
    # total: 1.00 + 2.01 + 2.01 + 4.02 + 2.00 + 0.44 + 2.00 + 3.15 + critic 0.94 + 1.88 + 1.88 + 3.75 + 2.00 + 0.44
    # + 2.00 = 29.52 GB (29.49 unrounded)
    assert rows["policy activations"] == "2.00 GB" and rows["total"] == "29.49 GB"
    # vLLM, TP 2: 16.06 GB bf16 / 2 = 8.03 GB; KV 0.85 x 80 - 8.03 = 59.97 GB at 65,536 B/token
    assert rows["vLLM weights"] == "8.03 GB" and rows["vLLM KV cache"] == "59.97 GB" and "915,066 tokens" in out
    # scoring on its own GPU: reference bf16 weights computed in bf16 (as the policy), 8.03B x 2 B = 16.06 GB,
    # reward model 7.505B x 2 B = 15.01 GB; reference logits bf16 16 x 2048 x 128256 x 2 B = 8.41 GB + 2 float32
    # chunks 2 x 1024 x 128256 x 4 B = 1.05 GB = 9.46 GB; 40.53 GB in all
    assert rows["reference weights"] == "16.06 GB" and rows["reward model 0 weights"] == "15.01 GB"
    assert rows["reference logits"] == "9.46 GB"
    assert _devices(out) == {
        "learner GPU (1 rank(s) each)": "29.49 GB",
        "rollout GPU (1 worker(s) each)": "68.00 GB",
        "scoring GPU (reference + reward models)": "40.53 GB",
    }  # nothing left on the host
    assert "verdict: fits" in out


def test_autocast_on_gpus_plans_float32_weights_and_no_masters(capsys):
    """learner.precision autocast (the CPU's choice), asked for on the 8B preset: float32 weights, gradients and
    AdamW (2.01 + 2.01 + 4.02 GB per rank at ZeRO-3 over 16), one gathered layer in float32, and the reference's
    float32 weights (8.03B x 4 B = 32.12 GB), as before master weights existed."""
    assert main(["plan", str(REPO / "configs/ppo_llama-8b_multinode_gpu.yaml"), "learner.precision=autocast"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["policy weights"] == "2.01 GB" and rows["policy gradients"] == "2.01 GB"
    assert rows["policy optimizer"] == "4.02 GB" and rows["policy gathered layer"] == "0.87 GB"
    assert "policy master weights" not in rows and rows["reference weights"] == "32.12 GB"
    assert rows["policy reduce bucket"] == "2.00 GB" and "policy reduce copy" not in rows  # 5e8 float32 elements


def test_grpo_qwen_preset_by_hand(capsys):
    assert main(["plan", str(REPO / "configs/grpo_qwen2.5-0.5b_1node_gpu.yaml")]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    # 3 vLLM workers + 4 learner ranks + the scoring service: the node's 8 GPUs, one each
    assert "rollout worker (x3, per device)" in out and "learner rank (x4)" in out
    assert "scoring service (GPU: cluster.gpus_per_scoring 1)" in out
    # policy logits: bf16 8 x 1536 x 151936 x 2 B = 3.73 GB, x 2 with the gradient = 7.47 GB; rows of 1536
    # tokens > 1024: chunks of 1024, 2 x 1024 x 151936 x 4 B = 1.24 GB -> 8.71 GB
    assert rows["policy logits"] == "8.71 GB"
    # reference: 494.03M x 2 B (bf16 weights, as the policy's under master weights) = 0.99 GB; logits 16 x 1536 x
    # 151936 x 2 B = 7.47 GB + 2 x 1024 x 151936 x 4 B = 1.24 GB -> 8.71 GB; 9.70 GB on the scoring GPU
    assert rows["reference weights"] == "0.99 GB" and rows["reference logits"] == "8.71 GB"
    assert _devices(out)["scoring GPU (reference + reward models)"] == "9.70 GB"


def test_async_training_counts_the_staged_weights_on_the_learner(capsys):
    qwen = str(REPO / "configs/grpo_qwen2.5-0.5b_1node_gpu.yaml")
    assert main(["plan", qwen]) == 0
    assert "policy staged weights" not in _rows(capsys.readouterr().out)  # sync: sent straight from the weights
    assert main(["plan", qwen, "async_training.mode=one_step"]) == 0
    # 494.03M params in the engines' bfloat16: 0.99 GB, held by rank 0 between syncs
    assert _rows(capsys.readouterr().out)["policy staged weights"] == "0.99 GB"


def test_scoring_joins_the_colocated_gpu(capsys):
    # colocated on shared GPUs: the scoring models stay resident on the device; their logits only
    # while scoring (vLLM awake), the weights also during the update (vLLM asleep)
    base = ["plan", str(REPO / "configs/grpo_qwen2.5-0.5b_1node_gpu.yaml"), "cluster.colocate=true"]
    assert main(base) == 1  # vLLM's 0.85 of the GPU leaves no room for the scoring service awake
    devices = _devices(capsys.readouterr().out)
    assert list(devices) == [
        "GPU awake: vLLM + learner states + scoring",
        "GPU asleep: learner update + scoring weights",
    ]
    # awake: vLLM 68.00 + learner states (ZeRO-2 over 4, bf16 weights 0.99, float32 masters 0.49, gradient sums
    # 0.49, AdamW 0.99, the bf16 reduce bucket 494M x 2 B = 0.99) 3.95 + scoring 9.70 = 81.65 GB (over 72);
    # asleep: learner 16.98 (13.02 + the bucket 0.99 + its bf16 flat and float32 copies while reduced 494M x 6 B =
    # 2.96) + reference weights 0.99 = 17.96 GB (17.97 from rounded parts)
    assert devices["GPU awake: vLLM + learner states + scoring"] == "81.65 GB"
    assert devices["GPU asleep: learner update + scoring weights"] == "17.96 GB"
    # a judge on its own vLLM engine never sleeps: its weights and KV cache (0.1 x 80 GB = 8 GB) stay, awake or not
    judge = "{kind: judge, model_path: 'builtin://tiny-addition-gpt', judge_gpu_memory_utilization: 0.1}"
    assert main(base + [f"reward.sources=[{{kind: math_answer}}, {judge}]"]) == 1
    with_judge = _devices(capsys.readouterr().out)
    assert with_judge["GPU asleep: learner update + scoring weights"] == "25.96 GB"
    assert with_judge["GPU awake: vLLM + learner states + scoring"] == "89.65 GB"
    # without a GPU it is back in host memory, next to nothing else
    assert main(base + ["cluster.gpus_per_scoring=0"]) == 0
    devices = _devices(capsys.readouterr().out)
    # 68.00 + 3.95 = 71.95 GB (under 72)
    assert devices["GPU awake: vLLM + learner states"] == "71.95 GB" and devices["host: scoring"] == "9.70 GB"


def test_smaller_gpu_does_not_fit(capsys):
    assert main(["plan", str(REPO / "configs/ppo_llama-8b_multinode_gpu.yaml"), "--gpu-memory-gb", "24"]) == 1
    out = capsys.readouterr().out
    assert "learner GPU" in out and "OVER" in out and "verdict: does not fit" in out


def test_unknown_missing_model_names_the_key(capsys):
    rc = main(["plan", str(REPO / "configs/grpo_tiny_cpu.yaml"), "learner.model_path=/nowhere/mystery-7b"])
    assert rc == 2
    assert "learner.model_path: /nowhere/mystery-7b" in capsys.readouterr().err


def _peak_allocated(trace: Path) -> int:
    """The CPU allocator's high-water mark over the profile: bytes allocated while profiling, alive."""
    events = json.loads(trace.read_text())["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def _profiled_peak(fn, tmp_path: Path) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    return _peak_allocated(tmp_path / "trace.json")


@pytest.mark.parametrize("temps", ["backward", "backward with entropy", "no grad"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_line_matches_chunked_logprobs_peak(temps, dtype, tmp_path):
    """The logits line alone: an lm_head (hidden -> vocab) and runtime.logprobs on 8 x 128 tokens in
    chunks of 64: the logits, their gradient and CHUNK_TEMPS float32 chunks, within 10%."""
    from runtime.logprobs import chunked_logprobs, chunked_logprobs_entropy

    b, t, v, chunk, grad = 8, 128, 8192, 64, temps != "no grad"

    def step():
        h = torch.randn(b, t, 16, dtype=getattr(torch, dtype), requires_grad=grad)  # small next to the logits
        head = torch.randn(v, 16, dtype=h.dtype, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            logits, labels = h @ head.T, torch.randint(0, v, (b, t))
            if temps == "backward with entropy":  # entropy_coef != 0: the entropy is in the loss
                logp, ent = chunked_logprobs_entropy(logits, labels, 0.7, chunk, entropy_grad=True)
                loss = logp.mean() + 1e-3 * ent.mean()
            else:
                loss = chunked_logprobs(logits, labels, 0.7, chunk).mean()
            del logits
            if grad:
                loss.backward()

    measured = _profiled_peak(step, tmp_path) - 2 * 16 * (b * t + v) * P.DTYPE_BYTES[dtype]  # less h, head and grads
    planned, _ = P.logits_bytes(P.ModelShape("llama", 1, 16, 1, 1, 16, v, True), b, t, dtype, chunk, temps)
    print(f"{temps} {dtype}: planned {planned / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB")
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)


def test_learner_figure_within_20_percent_of_measured_peak(tmp_path):
    """A 4-layer, 512-wide GPT-2 (vocab 8192: 16.9M params) trained as relay's learner runs it:
    policy forward on micro-batch 8 x 128 tokens, logprobs through runtime.logprobs.chunked_logprobs
    in chunks of learner.logprob_chunk_tokens=256 (2 rows: 4 chunks, so chunking is exercised),
    backward, torch AdamW. The model is built inside the profiler so every byte goes through its allocator."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from learner.models import PolicyValue
    from runtime.logprobs import chunked_logprobs

    GPT2Config(
        vocab_size=8192,
        n_positions=128,
        n_embd=512,
        n_layer=4,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ).save_pretrained(tmp_path)
    cfg = load_config(
        REPO / "configs/grpo_tiny_cpu.yaml",
        [
            f"learner.model_path={tmp_path}",
            "rollout.max_prompt_tokens=64",
            "rollout.sampling.max_new_tokens=64",
            "rollout.max_model_len=128",
            "algorithm.micro_batch_size=8",
            "learner.logprob_chunk_tokens=256",
        ],
    )
    learner = dict(plan_train(cfg, 80 * P.GB, None).sections)["learner rank (x1)"]
    planned, chunk = total(learner), cfg.learner.logprob_chunk_tokens

    torch.manual_seed(0)
    b, t = 8, 128
    ids, mask, pos = torch.randint(0, 8192, (b, t)), torch.ones(b, t, dtype=torch.long), torch.arange(t).expand(b, t)

    def train():
        model = PolicyValue(GPT2LMHeadModel(GPT2Config.from_pretrained(tmp_path)), value_head=False).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):  # the second step runs with AdamW's moments allocated
            logits = model(ids, mask, pos)[
                0
            ]  # the model's own (B, L-1, V), as learner.micro_batch_loss.policy_loss gets them
            loss = -chunked_logprobs(logits, ids[:, 1:], 1.0, chunk).mean()  # entropy_coef 0: no entropy term
            del logits
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss

    measured = _profiled_peak(train, tmp_path)
    print(
        f"planned learner {planned / 1e6:.1f} MB, measured peak {measured / 1e6:.1f} MB, ratio {planned / measured:.3f}"
    )
    assert abs(planned - measured) <= 0.2 * measured


def test_episodes_are_planned_at_their_token_budget_not_one_turn():
    from envs.config import EnvConfig

    assert EnvConfig().response_tokens(16) == 16  # no environment: one response
    assert EnvConfig(name="calculator", max_turns=3).response_tokens(16) == 48
    assert EnvConfig(name="calculator", max_turns=3, max_episode_tokens=40).response_tokens(16) == 40
    single = ["env.name=", "reward.sources=[{kind: exact_match}]"]
    cfgs = [
        load_config(REPO / "configs" / "calculator_tiny_cpu.yaml", over)
        for over in ([], single, single + ["rollout.sampling.max_new_tokens=48"])  # 3 turns x 16 tokens
    ]
    lines = [{k: v for k, v, _ in dict(plan_train(c, 80 * P.GB, None).sections)["learner rank (x1)"]} for c in cfgs]
    episodes, one_turn, as_long = (x["policy logits"] for x in lines)
    assert episodes == as_long > one_turn  # planned as a response of the episode's 48 tokens


def test_a_judge_model_counts_in_the_scoring_service(capsys):
    judge = "{kind: judge, model_path: 'builtin://tiny-addition-gpt', weight: 0}"
    main(["plan", "configs/grpo_tiny_cpu.yaml"])
    without = _rows(capsys.readouterr().out)
    main(["plan", "configs/grpo_tiny_cpu.yaml", f"reward.sources=[{{kind: math_answer}}, {judge}]"])
    out = capsys.readouterr().out
    rows = _rows(out)
    # the tiny GPT's weights in float32, as the reference's (the same model)
    assert rows["judge 1 weights"] == rows["reference weights"] == without["reference weights"]
    assert "reward.sources[1].model_path = builtin://tiny-addition-gpt" in out
    # its own vLLM engine (the default) holds a KV cache of judge_kv_cache_gb; under transformers it has none
    for engine, kv in (("vllm", 2), ("vllm", 3), ("transformers", 3)):
        other = f"{judge[:-1]}, judge_engine: {engine}, judge_kv_cache_gb: {kv}}}"
        main(["plan", "configs/grpo_tiny_cpu.yaml", f"reward.sources=[{{kind: math_answer}}, {other}]"])
        rows = _rows(capsys.readouterr().out)
        assert rows.get("judge 1 KV cache") == (f"{kv * 2**30 / 1e9:.2f} GB" if engine == "vllm" else None), rows


def test_packing_keeps_the_worst_case_and_says_so():
    """Packed rows are never longer than the longest sequence: at full length they hold the padded rows' tokens."""
    sections = {}
    for packing in (False, True):
        cfg = load_config(REPO / "configs" / "grpo_smollm2_cpu.yaml", [f"learner.packing={packing}"])
        sections[packing] = dict(plan_train(cfg, 80 * P.GB, None).sections)["learner rank (x1)"]
    assert [b for _, b, _ in sections[False]] == [b for _, b, _ in sections[True]]
    notes = {
        packing: dict((k, how) for k, _, how in lines)["policy activations"] for packing, lines in sections.items()
    }
    assert "packed" in notes[True] and "packed" not in notes[False]


def test_eager_attention_and_wide_packed_rows_add_what_they_keep():
    base = ["learner.packing=true"]
    lines = {}
    for name, extra in {
        "sdpa": [],
        "eager": ["learner.attn_implementation=eager"],
        "wide": ["learner.packing_row_tokens=1200"],
    }.items():
        cfg = load_config(REPO / "configs" / "grpo_smollm2_cpu.yaml", base + extra)
        learner = dict(plan_train(cfg, 80 * P.GB, None).sections)["learner rank (x1)"]
        lines[name] = {k: v for k, v, _ in learner}
    mb, tokens, size = 16, 96 + 24, P.DTYPE_BYTES[cfg.learner.dtype.value]  # SmolLM2: 30 layers, 9 heads
    assert "policy attention scores" not in lines["sdpa"] and "policy attention mask" not in lines["sdpa"]
    # eager: 2 x layers x heads x micro-batch x tokens x width x bytes, width = the sequence
    assert lines["eager"]["policy attention scores"] == 2 * 30 * 9 * mb * tokens * tokens * size
    assert lines["wide"]["policy attention mask"] == mb * tokens * 1200  # rows of 1,200 tokens: a bool [W, W] each


def test_an_adapter_sync_counts_the_adapter_a_sync_sends_and_the_engines_lora_memory():
    """learner.lora.sync adapter: the engine's LoRA slots (2 adapters of the slot rank on every linear vLLM's LoRA
    wraps) and the adapters it holds (2 at most, each what one sync sends); the merged path has neither."""
    from orchestrator.tools.plan_roles import LLAMA_LINEAR

    over = ["learner.lora.rank=12", "learner.dtype=float32", "rollout.dtype=float32"]
    cfg = load_config(REPO / "configs" / "grpo_smollm2_cpu.yaml", [*over, "learner.lora.sync=adapter"])
    rollout = {k: v for k, v, _ in dict(plan_train(cfg, 80 * P.GB, None).sections)["rollout worker (x1, per device)"]}
    s = dict(P.KNOWN)[("smollm2-135m",)]
    adapter = P.lora_params(s, 12, ["q_proj", "k_proj", "v_proj", "o_proj"]) * 4
    assert rollout["vLLM LoRA adapters"] == 2 * adapter and rollout["vLLM LoRA slots"] == 2 * 4 * P.lora_params(
        s, 16, LLAMA_LINEAR
    )  # rank 12 sits in vLLM's rank-16 slots
    merged = load_config(REPO / "configs" / "grpo_smollm2_cpu.yaml", [*over, "learner.lora.sync=merged"])
    lines = dict(plan_train(merged, 80 * P.GB, None).sections)["rollout worker (x1, per device)"]
    assert not any("LoRA" in what for what, _, _ in lines)
    gpt2 = load_config(
        REPO / "configs" / "grpo_tiny_cpu.yaml",
        ["learner.lora.rank=4", "learner.lora.target_modules=[c_attn]", "learner.lora.sync=adapter"],
    )
    assert any("vLLM serves no LoRA for GPT-2" in problem for problem in plan_train(gpt2, 80 * P.GB, None).problems)


def test_under_lora_the_scoring_service_holds_no_copy_of_the_reference():
    """learner.lora.reference learner (LoRA's default): the reference is the learner's base, its adapter off, so
    the scoring service's reference weights and logits are gone from the plan; reference scoring keeps them."""
    over = ["learner.lora.rank=12", "learner.dtype=float32", "rollout.dtype=float32"]

    def scoring(extra: list[str]) -> dict:
        cfg = load_config(REPO / "configs" / "grpo_smollm2_cpu.yaml", [*over, *extra])
        section = next(v for k, v in plan_train(cfg, 80 * P.GB, None).sections if k.startswith("scoring service"))
        return {k: v for k, v, _ in section}

    in_learner, on_scoring = scoring([]), scoring(["learner.lora.reference=scoring"])
    s = dict(P.KNOWN)[("smollm2-135m",)]
    assert on_scoring["reference weights"] == P.param_count(s) * 4 and on_scoring["reference logits"] > 0
    assert in_learner["reference weights"] == 0 and "reference logits" not in in_learner
