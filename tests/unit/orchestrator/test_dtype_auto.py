"""`dtype: auto`: the choice as a pure function of each capability set, the tree resolved in place (a run,
a pipeline with its GPU stage), the line printed at launch and in `relay plan`, the warning an explicit
bf16 gets without native bf16, and the refusal where nothing can be asked."""

import pytest
import torch

from learner.config import Dtype, LearnerConfig, Precision
from orchestrator.cli import main
from orchestrator.config.dtype import (
    CPU_AUTOCAST,
    LORA_AUTOCAST,
    MASTERS,
    Capabilities,
    choose,
    choose_precision,
    cpu_flags,
    probe,
    resolve_dtypes,
    resolve_precision,
)
from orchestrator.config.load import ConfigError, load_config
from orchestrator.config.schema import PipelineConfig, TrainConfig
from runtime.device import compute
from tests.helpers import REPO

SMOLLM2 = REPO / "configs" / "grpo_smollm2_cpu.yaml"
KEYS = "learner.dtype, rollout.dtype"
AVX2 = Capabilities("cpu", "AVX2", False, bf16_kernels=False)  # the 2-core EPYC of the issue
AVX512 = Capabilities("cpu", "AVX512", False, bf16_kernels=True)  # oneDNN emulates bf16
AVX512_BF16 = Capabilities("cpu", "AVX512_BF16", True)
AMX = Capabilities("cpu", "AMX_BF16", True)
H100 = Capabilities("cuda", "NVIDIA H100 80GB HBM3", True)
V100 = Capabilities("cuda", "Tesla V100-SXM2-16GB", False)
UNSEEN_GPU = Capabilities("cuda", "", None)  # the learner on GPUs, none visible to this process


@pytest.mark.parametrize(
    "caps, dtype, line",
    [
        (AVX2, "float32", f"dtype auto -> float32 ({KEYS}): this CPU has no native bf16 (AVX2)"),
        (AVX512, "float32", f"dtype auto -> float32 ({KEYS}): this CPU has no native bf16 (AVX512)"),
        (AVX512_BF16, "bfloat16", f"dtype auto -> bfloat16 ({KEYS}): this CPU has native bf16 (AVX512_BF16)"),
        (AMX, "bfloat16", f"dtype auto -> bfloat16 ({KEYS}): this CPU has native bf16 (AMX_BF16)"),
        (H100, "bfloat16", f"dtype auto -> bfloat16 ({KEYS}): this GPU has native bf16 (NVIDIA H100 80GB HBM3)"),
        (V100, "float32", f"dtype auto -> float32 ({KEYS}): this GPU has no native bf16 (Tesla V100-SXM2-16GB)"),
    ],
)
def test_auto_picks_bf16_only_where_the_device_has_it_natively_and_says_why(caps, dtype, line):
    choice = choose("auto", caps, KEYS)
    assert (choice.dtype, choice.line, choice.problem) == (dtype, line, "")


@pytest.mark.parametrize(
    "caps, slowdown",
    [
        (AVX2, "scalar bf16 matmuls here, measured 50-100x slower than float32"),
        (AVX512, "oneDNN emulates bf16 on it"),
        (V100, "emulated, slower"),
    ],
)
def test_an_explicit_bf16_without_native_bf16_is_kept_with_a_warning_naming_the_keys(caps, slowdown):
    choice = choose("bfloat16", caps, KEYS)
    assert choice.dtype == "bfloat16" and not choice.problem  # an explicit choice is never refused
    assert choice.line.startswith(f"warning: {KEYS} = bfloat16 on a ") and f"({caps.name})" in choice.line
    assert slowdown in choice.line and "dtype auto (or float32) avoids it" in choice.line


@pytest.mark.parametrize("caps", [AVX512_BF16, AMX, H100, UNSEEN_GPU])
def test_bf16_where_it_is_native_or_cannot_be_known_says_nothing(caps):
    assert choose("bfloat16", caps, KEYS).line == "" and choose("float32", caps, KEYS).line == ""
    assert choose("float32", AVX2, KEYS).dtype == "float32"


def test_auto_on_gpus_this_process_cannot_see_is_refused_naming_both_keys():
    choice = choose("auto", UNSEEN_GPU, KEYS)
    assert "learner.dtype and rollout.dtype" in choice.problem and "cluster.gpus_per_learner" in choice.problem


def test_cpu_flags_read_x86_flags_and_arm_features(tmp_path):
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "avx512f", "avx512_bf16"}  # the first CPU's
    assert "bf16" in cpu_flags(str(arm)) and cpu_flags(str(tmp_path / "none")) == set()


def test_the_cpu_probe_follows_this_machines_flags():
    caps, flags = probe("cpu"), cpu_flags()
    assert caps.device == "cpu" and caps.native_bf16 == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    native = {"AMX_BF16", "AVX512_BF16", "BF16"}
    assert caps.name in native if caps.native_bf16 else caps.name == torch.backends.cpu.get_cpu_capability()


def test_resolution_sets_each_section_from_its_own_device_in_place():
    seen = []

    def fake_probe(device):  # the capability set under test; counts the probes
        seen.append(device)
        return {"cpu": AVX2, "cuda": H100}[device]

    run = TrainConfig(learner=LearnerConfig(model_path="m", dtype=Dtype.auto))
    run.rollout.dtype = "auto"
    lines, problems = resolve_dtypes(run, fake_probe)
    assert run.learner.dtype is Dtype.float32 and run.rollout.dtype == "float32" and not problems
    assert lines == [f"dtype auto -> float32 ({KEYS}): this CPU has no native bf16 (AVX2)"] and seen == ["cpu"]

    pipe = PipelineConfig()
    pipe.sft.learner.dtype = pipe.rm.learner.dtype = pipe.ppo.learner.dtype = Dtype.auto
    pipe.ppo.rollout.dtype, pipe.ppo.cluster.gpus_per_learner = "auto", 1
    lines, _ = resolve_dtypes(pipe, fake_probe)
    assert pipe.sft.learner.dtype is Dtype.float32 and pipe.rm.learner.dtype is Dtype.float32  # stages: CPU
    assert pipe.ppo.learner.dtype is Dtype.bfloat16 and pipe.ppo.rollout.dtype == "bfloat16"  # its GPUs
    assert sorted(lines) == [
        "dtype auto -> bfloat16 (ppo.learner.dtype, ppo.rollout.dtype): this GPU has native bf16 "
        "(NVIDIA H100 80GB HBM3)",
        "dtype auto -> float32 (rm.learner.dtype, sft.learner.dtype): this CPU has no native bf16 (AVX2)",
        f"ppo.learner.precision auto -> master_weights: {MASTERS}",
    ]
    assert pipe.ppo.learner.precision is Precision.master_weights  # bf16 on a GPU: bf16 weights, float32 masters
    assert pipe.sft.learner.precision is Precision.autocast  # float32: nothing to choose, nothing said
    assert resolve_dtypes(TrainConfig(), fake_probe) == ([], []) and seen == ["cpu", "cuda", "cpu"]  # float32: none


def test_a_rollout_auto_beside_an_explicit_learner_dtype_takes_the_learners():
    # rollout.dtype auto is "learner.dtype's choice": with learner.dtype named (float32, the default) it
    # is that, not the device's own choice, which made a config refused on a bf16 CPU ("differs from
    # learner.dtype") that ran on an AVX2 one
    run = TrainConfig(learner=LearnerConfig(model_path="m"))
    run.rollout.dtype = "auto"
    assert resolve_dtypes(run, lambda device: AVX512_BF16) == ([], []) and run.rollout.dtype == "float32"
    run = TrainConfig(learner=LearnerConfig(model_path="m", dtype=Dtype.bfloat16))
    run.rollout.dtype = "auto"
    lines, problems = resolve_dtypes(run, lambda device: AVX2)
    assert run.rollout.dtype == "bfloat16" and not problems and lines[0].startswith(f"warning: {KEYS} = bfloat16")


def test_the_smollm2_preset_asks_for_auto_and_the_launch_prints_the_choice_once(capsys):
    assert "dtype: auto" in SMOLLM2.read_text()
    expected = choose("auto", probe("cpu"), KEYS)
    cfg = load_config(SMOLLM2, [])
    assert (cfg.learner.dtype.value, cfg.rollout.dtype) == (expected.dtype, expected.dtype)
    assert capsys.readouterr().err == f"relay: {expected.line}\n" + PRECISION_LINE * (expected.dtype == "bfloat16")
    warning = choose("bfloat16", probe("cpu"), KEYS).line  # "" on a CPU with native bf16
    load_config(SMOLLM2, ["learner.dtype=bfloat16", "rollout.dtype=bfloat16"])
    assert capsys.readouterr().err == (f"relay: {warning}\n" if warning else "") + PRECISION_LINE


PRECISION_LINE = f"relay: learner.precision auto -> autocast: {CPU_AUTOCAST}\n"  # bf16 on a CPU


def test_relay_plan_says_which_dtype_auto_chose_and_why(capsys):
    expected = choose("auto", probe("cpu"), KEYS)
    assert main(["plan", str(SMOLLM2)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[1] == expected.line and out.err == ""  # in the report, once
    assert f"{expected.dtype}" in out.out.split("learner rank")[1]  # the plan is made in the chosen dtype


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process sees a GPU it can ask")
def test_auto_for_a_gpu_learner_this_process_cannot_see_is_a_config_error():
    with pytest.raises(ConfigError, match=r"learner.dtype: auto cannot tell whether the learner's GPUs have bf16"):
        load_config(REPO / "configs" / "grpo_qwen2.5-0.5b_1node_gpu.yaml", ["learner.dtype=auto", "rollout.dtype=auto"])


def test_an_unresolved_auto_never_runs_as_float32_silently():
    with pytest.raises(ValueError, match="learner.dtype 'auto'"):
        compute(Dtype.auto, torch.device("cpu"))


def test_precision_auto_is_master_weights_on_gpus_and_autocast_on_cpus_and_an_explicit_one_stays():
    assert choose_precision("bfloat16", "cuda")[0] is Precision.master_weights
    assert choose_precision("bfloat16", "cpu") == (Precision.autocast, CPU_AUTOCAST)
    assert choose_precision("float32", "cuda") == (Precision.autocast, "")  # float32 weights: nothing to say
    assert choose_precision("bfloat16", "cuda", lora=True) == (Precision.autocast, LORA_AUTOCAST)
    run = TrainConfig(learner=LearnerConfig(model_path="m", dtype=Dtype.bfloat16))
    run.rollout.dtype = "bfloat16"
    assert resolve_precision(run) == [f"learner.precision auto -> autocast: {CPU_AUTOCAST}"]
    assert run.learner.precision is Precision.autocast
    run = TrainConfig(learner=LearnerConfig(model_path="m", dtype=Dtype.bfloat16, precision=Precision.master_weights))
    assert resolve_precision(run) == [] and run.learner.precision is Precision.master_weights  # asked: kept


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"learner.precision": "master_weights"}, "set learner.dtype=bfloat16"),
        (
            {
                "learner.precision": "master_weights",
                "learner.dtype": "bfloat16",
                "rollout.dtype": "bfloat16",
                "learner.lora.rank": 4,
            },
            "use precision=autocast with LoRA",
        ),
    ],
)
def test_master_weights_refuses_float32_and_lora_naming_the_key(tiny_model, over, says):
    args = [f"learner.model_path={tiny_model}", *(f"{k}={v}" for k, v in over.items())]
    with pytest.raises(ConfigError, match=f"learner.precision: .*{says}"):
        load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", args)


def test_a_gpu_preset_with_lora_resolves_to_autocast_and_loads():
    """precision auto never chooses what the config rules refuse: LoRA with bf16 weights."""
    qwen = REPO / "configs" / "grpo_qwen2.5-0.5b_1node_gpu.yaml"
    assert load_config(qwen, []).learner.precision is Precision.master_weights
    assert load_config(qwen, ["learner.lora.rank=8"]).learner.precision is Precision.autocast


def test_a_stage_refuses_master_weights_in_float32_too():
    from orchestrator.config.schema import StageConfig

    with pytest.raises(ConfigError, match="learner.precision: master_weights holds bf16 weights"):
        load_config(REPO / "configs" / "sft_tiny_cpu.yaml", ["learner.precision=master_weights"], root=StageConfig)
