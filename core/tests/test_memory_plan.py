"""The run's memory plan (rlcore.planning.run_memory): the engine's share and the trainer's release chosen from
the model, batch and card when the recipe leaves them auto; runs that cannot fit refused before anything loads,
naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import rlcore
from rlcore.config import ConfigError
from rlcore.planning.hardware import GPUS
from rlcore.planning.run_memory import PlanRefused, plan_run_memory
from rlcore.planning.shapes import from_hf_config

LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True, "model_type": "llama",
            "architectures": ["LlamaForCausalLM"], "head_dim": 64}
LLAMA_3B = {**LLAMA_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128,
            "intermediate_size": 8192}
LLAMA_8B = {**LLAMA_1B, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 128,
            "intermediate_size": 14336, "tie_word_embeddings": False}
LLAMA_1B_PARAMS = 1_235_814_400  # Llama 3.2 1B: 16 layers of 60.8M, the tied 262.7M embedding
H100 = GPUS["h100"]
# two sequences a micro-batch: a 3.2B full fine-tune's 8192-token micro-batch (19 GiB of activations) does not fit
# beside its 54 GiB of weights, gradients and Adam state on an 80 GB card
MB_3B = {"policy.sequence_packing.train_mb_tokens": "2176"}
REPO = Path(__file__).resolve().parents[2]


def config(backend: str = "megatron", **overrides):
    tree = {
        "policy": {"model_name": "unused", "precision": "bfloat16", "max_total_sequence_length": 1088,
                   "sequence_packing": {"enabled": True, "train_mb_tokens": 8192, "logprob_mb_tokens": 16384},
                   "dtensor_cfg": {"enabled": backend == "fsdp2"}, "megatron_cfg": {"enabled": backend == "megatron"},
                   "generation": {"backend": "vllm", "max_new_tokens": 1024, "dtype": "bfloat16"}},
        "algorithm": {"name": "grpo"}, "data": {"name": "arithmetic"}, "env": {"name": "math"},
        "train": {"num_prompts_per_step": 32}, "grpo": {"num_generations_per_prompt": 8},
        "cluster": {"gpus_per_node": 1},
    }
    return rlcore.build_config(tree, [f"{k}={v}" for k, v in overrides.items()])


def plan(cfg, hf=LLAMA_1B, gpu=H100, *, critic=False):
    return plan_run_memory(cfg, from_hf_config("m", hf), gpu, 1, critic=critic)


def test_auto_is_the_default_and_numbers_still_parse():
    cfg = config()
    assert cfg.generation.gpu_memory_utilization == "auto"
    assert cfg.generation.colocated.offload_trainer_state == "auto"
    cfg = config(**{"policy.generation.gpu_memory_utilization": "0.3",
                    "policy.generation.colocated.offload_trainer_state": "true"})
    assert cfg.generation.gpu_memory_utilization == 0.3 and cfg.generation.colocated.offload_trainer_state is True
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        config(**{"policy.generation.gpu_memory_utilization": "1.5"})
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        config(**{"policy.generation.gpu_memory_utilization": "half"})


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_the_engine_gets_what_the_trainer_leaves_free(backend):
    p = plan(config(backend))
    m = p.memory
    assert m.fits and not p.offload_trainer_state  # 1.2B: its Adam state and the engine fit an 80 GB card together
    kept = sum(v for k, v in m.gen_parts.items() if not k.startswith(("engine", "kv_cache")))
    # room to spare: the engine gets twice the KV cache the step's 256 sequences need (and its weights and
    # overhead), and the trainer's weights, gradients and Adam state stay beside it, below the card's headroom
    assert m.engine_kv_gib == pytest.approx(2 * m.kv_need_gib)
    engine = m.gen_parts["engine_weights"] + m.gen_parts["engine_other"] + m.engine_kv_gib
    assert p.engine_fraction * H100.memory_gib == pytest.approx(engine, abs=0.001 * H100.memory_gib)
    assert kept + engine < m.limit_gib
    assert m.gen_parts["optimizer"] > 8  # 1.24B parameters x (fp32 main weights and two moments) = 14.8 GB
    assert (m.gen_parts["gradients"] > 4) == (backend == "megatron")  # fsdp2 sets its gradients to None after a step
    assert "gpu_memory_utilization=" in p.line() and "offload_trainer_state=false" in p.line()


def test_the_engine_takes_what_is_free_when_that_is_less_than_it_wants():
    # 4096 sequences of 1088 tokens want 135 GiB of KV cache: the H100 gives what the trainer leaves free
    # (the card less the headroom), the H200 more of it, neither past the cap
    many = config(**{"train.num_prompts_per_step": 512, "policy.generation.max_num_seqs": 4096})
    on_h100, on_h200 = plan(many), plan(many, gpu=GPUS["h200"])
    kept = sum(v for k, v in on_h100.memory.gen_parts.items() if not k.startswith(("engine", "kv_cache")))
    assert on_h100.engine_fraction * H100.memory_gib == pytest.approx(on_h100.memory.limit_gib - kept, abs=0.01 * H100.memory_gib)
    assert on_h200.engine_fraction * 140.4 > on_h100.engine_fraction * 79.6
    assert on_h100.memory.kv_short and on_h200.engine_fraction <= 0.9


def test_a_critic_keeps_its_state_beside_the_policys():
    alone, ppo = plan(config()), plan(config(), critic=True)
    assert ppo.memory.gen_parts["critic_state"] == pytest.approx(
        sum(alone.memory.gen_parts[k] for k in ("weights", "gradients", "optimizer")))
    # here both fit beside the engine it wants: the critic's state is the whole difference
    assert ppo.engine_fraction == alone.engine_fraction
    assert sum(ppo.memory.gen_parts.values()) - sum(alone.memory.gen_parts.values()) == pytest.approx(
        ppo.memory.gen_parts["critic_state"])


def test_an_fsdp2_critic_keeps_its_float32_shards_and_adam_state_between_its_passes():
    """FSDP2 frees the copy its passes gather when each ends, and its optimizer step sets the gradients to None: the
    critic's state beside the training policy and the awake engine is its float32 weights and Adam's two moments
    (12 bytes a parameter), where Megatron's keeps its gradient buffers too."""
    alone, ppo = plan(config("fsdp2")), plan(config("fsdp2"), critic=True)
    train = alone.memory.train_parts
    assert train["gathered_weights"] > 0 and train["gradients"] > 0
    assert ppo.memory.train_parts["critic_state"] == pytest.approx(train["weights"] + train["optimizer"])
    # to the final norm's 2,048 weights, which the layer count leaves out
    assert ppo.memory.train_parts["critic_state"] == pytest.approx(LLAMA_1B_PARAMS * 12 / 2**30, rel=1e-5)
    assert ppo.memory.gen_parts["critic_state"] == pytest.approx(train["weights"] + train["optimizer"])
    # the policy's own weights while the engine is awake still count its gathered copy (the safe side)
    assert ppo.memory.gen_parts["weights"] == pytest.approx(train["weights"] + train["gathered_weights"])
    megatron = plan(config(), critic=True).memory.train_parts
    assert megatron["critic_state"] == pytest.approx(megatron["weights"] + megatron["gradients"] + megatron["optimizer"])


@pytest.mark.parametrize("overrides", [{"policy.generation.async_engine": "true"}, {"grpo.async_grpo.enabled": "true"},
                                       {"policy.generation.experimental.engine_process": "true"},
                                       {"policy.generation.tensor_parallel_size": "2", "cluster.gpus_per_node": "2"}],
                         ids=["async-engine", "one-step-off", "engine-process-key", "engine-tp2"])
def test_an_engine_in_a_process_of_its_own_keeps_that_processs_context_while_it_sleeps(overrides):
    """The trainer's phases on a GPU a colocated engine sleeps on: an engine core (or TP worker) in a process of
    its own holds that process's CUDA context and workspace there too (the calibration's ``fixed_gib``); an
    in-process one shares the trainer's. The engine awake is unchanged: its share counts its own process."""
    from rlcore.planning.calibration import load_calibration

    fixed = load_calibration("h100").fixed_gib
    world = int(overrides.get("cluster.gpus_per_node", 1))
    same_cluster = {key: value for key, value in overrides.items() if key.startswith("cluster.")}
    in_process = plan_run_memory(config(**same_cluster), from_hf_config("m", LLAMA_1B), H100, world, critic=False)
    own = plan_run_memory(config(**overrides), from_hf_config("m", LLAMA_1B), H100, world, critic=False)
    assert own.memory.train_parts["other"] == pytest.approx(in_process.memory.train_parts["other"] + fixed)
    assert own.memory.gen_parts["other"] == in_process.memory.gen_parts["other"]
    # the generation section's schema decides: on CUDA, rlcore_vllm starts the engine where the planner says it is
    from rlcore_vllm.generator import engine_in_own_process as vllm_choice

    for async_grpo, key in [(False, None), (True, None), (False, True), (True, False)]:
        gen = config(**({} if key is None else {"policy.generation.experimental.engine_process": str(key).lower()})).generation
        assert gen.engine_in_own_process(async_grpo) == vllm_choice(key, device="cuda", colocated=True, async_grpo=async_grpo)
    assert config(**{"policy.generation.async_engine": "true",
                     "policy.generation.experimental.engine_process": "false"}).generation.engine_in_own_process(False)
    from rlcore.config import GenerationConfig

    assert not GenerationConfig().engine_in_own_process(True)  # a generator that says nothing shares the trainer's


def test_auto_releases_the_trainer_state_when_it_would_crowd_the_engine():
    # 3.2B: weights, fp32 gradients and Adam state are about 55 GiB; kept, the engine's KV cache holds
    # fewer sequences than the step's 256 decode at once
    p = plan(config(**MB_3B), hf=LLAMA_3B)
    assert p.offload_trainer_state and p.memory.gen_parts["optimizer"] == 0.0
    assert not p.memory.kv_short
    # set by the recipe: kept as it is (and still fits, with less KV cache)
    kept = plan(config(**MB_3B, **{"policy.generation.colocated.offload_trainer_state": "false"}), hf=LLAMA_3B)
    assert not kept.offload_trainer_state and kept.memory.kv_short
    # the async loop trains while the engine generates: its state cannot leave
    async_run = plan(config(**MB_3B, **{"grpo.async_grpo.enabled": "true"}), hf=LLAMA_3B)
    assert not async_run.offload_trainer_state


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_rlcore_plan_prices_the_recipe_with_the_runs_own_auto_release(backend):
    """``rlcore plan``'s row for the recipe takes the decision the run's memory plan takes for
    ``offload_trainer_state: auto``: released, it prices the state's trips to host memory; a recipe that sets
    ``false``, or the async loop, keeps it."""
    from rlcore.planning import plan as planning
    from rlcore.planning.calibration import load_calibration

    shape = from_hf_config("m", LLAMA_3B)

    def recipe_row(**overrides):
        cfg = config(backend, **MB_3B, **overrides)
        inp = planning.inputs(cfg, world=1, gpu_name="h100", model=shape, calibration=load_calibration("h100", user_file=Path("/dev/null")))
        return cfg, planning.evaluate_recipe(inp)

    cfg, auto = recipe_row()
    assert auto.layout.releases_state and auto.memory.gen_parts["optimizer"] == 0.0
    assert plan(cfg, hf=LLAMA_3B).offload_trainer_state  # the run decides the same
    if backend == "megatron":  # Megatron's release moves the state both ways each step (the offload phase)
        assert auto.phases["offload"] > 0
    for overrides in ({"policy.generation.colocated.offload_trainer_state": "false"}, {"grpo.async_grpo.enabled": "true"}):
        _, kept = recipe_row(**overrides)
        assert not kept.layout.releases_state and kept.memory.kv_short


def test_a_run_that_cannot_fit_is_refused_naming_the_key():
    with pytest.raises(PlanRefused) as info:  # 8B full fine-tuning: 8B x 18 bytes of state on one 80 GB card
        plan(config(), hf=LLAMA_8B)
    assert info.value.key == "policy.megatron_cfg.tensor_model_parallel_size"
    assert "training" in info.value.message and "largest: optimizer" in info.value.message
    with pytest.raises(PlanRefused) as info:
        plan(config("fsdp2"), hf=LLAMA_8B)
    assert info.value.key == "cluster.gpus_per_node"
    with pytest.raises(PlanRefused) as info:  # a hand-set share the trainer's state leaves no room for
        plan(config(**{"policy.generation.gpu_memory_utilization": "0.9"}))
    assert info.value.key == "policy.generation.gpu_memory_utilization"


def test_long_micro_batches_name_the_packing_key():
    cfg = config(**{"policy.max_total_sequence_length": 200000, "policy.sequence_packing.train_mb_tokens": 200000,
                    "policy.sequence_packing.logprob_mb_tokens": 200000, "policy.generation.max_new_tokens": 1024})
    with pytest.raises(PlanRefused) as info:
        plan(cfg)
    assert info.value.key == "policy.sequence_packing.train_mb_tokens"


def test_cpu_checks_training_against_host_memory():
    host = attrs.evolve(GPUS["h100"], name="cpu", memory_gib=64.0)
    ok = plan_run_memory(config(), from_hf_config("m", LLAMA_1B), host, 1, critic=False, cpu=True)
    assert ok.memory.gen_parts == {} and not ok.offload_trainer_state
    with pytest.raises(PlanRefused, match="does not fit"):
        plan_run_memory(config(), from_hf_config("m", LLAMA_8B), host, 1, critic=False, cpu=True)


def test_a_run_too_big_for_the_host_is_refused_before_the_model_loads(tmp_path):
    """The CLI, end to end: an 8B-shaped checkpoint directory (its config and a tokenizer, no weights) is
    refused before any weight is read, in one line naming the key, exit 2."""
    from rlcore.testing.tiny import build_tiny_model

    model = tmp_path / "model"
    build_tiny_model(model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()  # loading it would fail: the plan must refuse first
    (model / "config.json").write_text(json.dumps({**LLAMA_8B, "torch_dtype": "float32"}))
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "run", str(REPO / "recipes" / "grpo_arith_tiny_cpu.yaml"), f"policy.model_name={model}",
                           "policy.generation.backend=hf", f"logger.log_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config key 'cluster.gpus_per_node'" in proc.stderr and "does not fit" in proc.stderr
    assert "Traceback" not in proc.stderr


class _Recorder:
    """A trainer and a critic that record the moves asked of them (the fallback's control flow alone)."""

    def __init__(self, calls):
        self.calls = calls

    def offload(self, *, keep_weights=False):
        self.calls.append(("offload", keep_weights))

    def onload(self):
        self.calls.append(("onload",))


class _EngineShortOfMemory:
    """A generator whose first wake-up is refused for memory (a fault injected on purpose)."""

    def __init__(self, calls, refusals=1):
        self.calls, self.refusals = calls, refusals

    def wake_up(self):
        if self.refusals:
            self.refusals -= 1
            self.calls.append(("refused",))
            raise MemoryError("vLLM cannot wake up: its weights and KV cache need 40.0 GiB and the GPU has 30.0 free")
        self.calls.append(("woke",))


def test_a_refused_wake_up_releases_the_trainer_state_when_auto(capsys):
    from rlcore.controller.context import RunContext
    from rlcore.controller.learner import Learner

    calls = []
    learner = Learner(_Recorder(calls), algorithm=None, context=RunContext(8), max_consecutive_nonfinite=3,
                      critic=_Recorder(calls), may_offload=True)
    learner.wake(_EngineShortOfMemory(calls))
    assert calls == [("refused",), ("offload", True), ("offload", False), ("woke",)]  # the refit reads the policy's weights
    assert learner.offload_trainer_state  # from now on the state leaves after each training phase
    assert "from now on" in capsys.readouterr().out
    with learner.state_on_device():
        pass
    assert calls[-2:] == [("onload",), ("offload", True)]
    # set by the recipe (true or false), or a loop that cannot release: the refusal stands
    for learner in (Learner(_Recorder(calls), None, RunContext(8), 3, may_offload=False),
                    Learner(_Recorder(calls), None, RunContext(8), 3, offload_trainer_state=True, may_offload=True)):
        with pytest.raises(MemoryError, match="cannot wake up"):
            learner.wake(_EngineShortOfMemory([]))


def test_the_run_plans_with_the_calibration_of_the_gpu_it_is_on(monkeypatch):
    """The run's memory plan reads the calibration of its own GPU (it read the H200's on every GPU)."""
    from rlcore.planning import run_memory
    from rlcore.planning.calibration import load_calibration as real
    from rlcore.planning.hardware import gpu
    from rlcore.planning.shapes import resolve_shape

    asked = []
    monkeypatch.setattr(run_memory, "load_calibration", lambda name: asked.append(name) or real(name))
    config = rlcore.build_config({"policy": {"model_name": "m", "generation": {"backend": "vllm"}},
                                  "cluster": {"gpus_per_node": 1}})
    run_memory.plan_run_memory(config, resolve_shape("", "llama-3.2-1b"), gpu("h100"), 1, critic=False)
    assert asked == ["h100"]


def _one_gpu_recipes() -> list[Path]:
    import yaml

    out = []
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        cluster = yaml.safe_load(path.read_text()).get("cluster") or {}
        if cluster.get("gpus_per_node", 0) * cluster.get("num_nodes", 1) == 1:  # a CPU recipe sets 0 or leaves it
            out.append(path)
    return out


def _demo_shape_dir(tmp_path: Path, preset: str) -> Path:
    """The ``config.json`` of a ``rlcore.cli.demo --shape`` model (its weights are the demo's SFT warm start)."""
    from rlcore.cli.demo import MODEL_SHAPES
    from rlcore.testing.tiny import build_tokenizer, tiny_config

    shape = {k: v for k, v in MODEL_SHAPES[preset].items() if k != "init_std"}
    tiny_config("llama", vocab_size=len(build_tokenizer()), **shape).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("gpu_name", ["h100", "h200"])
@pytest.mark.parametrize("path", _one_gpu_recipes(), ids=lambda p: p.stem)
def test_every_one_gpu_recipe_fits_an_80_and_a_141_gb_card_as_shipped(path, gpu_name, tmp_path):
    """The shipped recipes for one GPU, with their own settings and nothing else, are planned to fit both cards, with the
    KV cache their step needs and the trainer's state kept on the GPU (a hand-set engine share of 0.6, NeMo-RL's, made
    the 80 GB card's plan send it to host memory and back every step)."""
    from rlcore.loading.loader import load_config, to_dict
    from rlcore.planning.plan import critic_shape
    from rlcore.planning.shapes import resolve_shape

    config = load_config(path)
    if config.policy.model_name.startswith("runs/"):  # the learning recipe's SFT warm start (rlcore.cli.demo --shape llama150m)
        config = load_config(path, [f"policy.model_name={_demo_shape_dir(tmp_path, 'llama150m')}"])
    shape = resolve_shape(config.policy.model_name)
    critic = critic_shape(to_dict(config), shape) is not None  # PPO's critic beside the policy, as `rlcore plan` decides
    run_plan = plan_run_memory(config, shape, GPUS[gpu_name], 1, critic=critic)
    assert run_plan.memory.fits and not run_plan.memory.kv_short, (path.stem, run_plan.memory.problem)
    assert not run_plan.offload_trainer_state, (path.stem, run_plan.engine_fraction)


def test_the_one_gpu_recipe_list_holds_the_gsm8k_and_learning_recipes():
    assert {p.stem for p in _one_gpu_recipes()} >= {"grpo_math_1B", "grpo_math_1B_megatron", "grpo_math_tool_1B",
                                                    "grpo_arith3_gpu"}
