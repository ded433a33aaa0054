"""Schemas of this plugin's config sections. Imports neither torch nor math-verify.

- ``env.math`` -> :class:`MathEnvConfig`, ``env.math_tool`` -> :class:`MathToolEnvConfig`.
- ``data`` (shared by all datasets, ``name`` picks one) -> :class:`MathFilesDatasetConfig`
  (``name: math_jsonl``) or :class:`ArithmeticDatasetConfig` (``name: arithmetic``).
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.environment import MultiTurnEnvConfig
from rlcore.config.structure import ConfigError, doc

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)

AnswerFormat = Literal["any", "boxed", "hash", "answer_is", "none"]
ARITHMETIC_OPERATIONS = ("+", "-", "*")


@frozen
class GradingConfig:
    """How answers are verified (math-verify) and how much time and input a verification may take."""

    executor: Literal["process", "ray", "inline"] = field(
        default="process",
        metadata=doc("where graders run: 'process' (a local process pool), 'ray' (Ray actors) or 'inline' "
                     "(the calling thread: no process start-up, but deadlines only in a main thread and nothing can kill a stuck C call)"),
    )
    num_workers: int = field(default=2, validator=_positive, metadata=doc("grader processes or Ray actors"))
    timeout_s: float = field(default=5.0, validator=_positive, metadata=doc("time limit of one verification (parse + compare)"))
    kill_grace_s: float = field(
        default=2.0, validator=_positive,
        metadata=doc("extra time after timeout_s before a stuck grader process is killed and replaced"),
    )
    chunk_size: int = field(default=64, validator=_positive, metadata=doc("responses sent to a worker at once"))
    max_response_chars: int = field(
        default=100_000, validator=_positive, metadata=doc("longer responses are rejected (reward 0, env/rejected) before parsing"),
    )
    answer_window_chars: int = field(
        default=4_000, validator=_positive, metadata=doc("only the last N characters of a response are searched for the answer"),
    )
    max_nesting_depth: int = field(
        default=12, validator=_positive,
        metadata=doc("answers nesting brackets deeper than this are rejected (env/rejected): sympy's LaTeX parsing is exponential in depth"),
    )
    float_rounding: int = field(default=6, validator=_non_negative, metadata=doc("decimal places compared for floats"))
    answer_format: AnswerFormat = field(
        default="any",
        metadata=doc("what counts as a well-formatted answer: \\boxed{}, '#### n', 'the answer is', any of them, or none required"),
    )
    strict_format: bool = field(default=False, metadata=doc("a correct value outside the required answer_format scores 0"))
    correct_reward: float = field(default=1.0, metadata=doc("reward of a correct answer"))
    format_reward: float = field(default=0.0, metadata=doc("added when the answer is well formatted (see answer_format)"))
    ray_address: str | None = field(default=None, metadata=doc("Ray cluster for executor 'ray'; None = the current or a local one"))


@frozen
class MathEnvConfig(GradingConfig):
    """Single-turn math: the model's one turn is graded against ``Sample.answer``."""


@frozen
class MathToolEnvConfig(GradingConfig, MultiTurnEnvConfig):
    """Multi-turn math with a calculator: ``<calc>expr</calc>`` turns get the result back; the turn
    keys (``max_turns``, ``observation_role``, ...) are core's :class:`MultiTurnEnvConfig`."""

    max_turns: int = field(default=4, validator=_positive, metadata=doc("model turns per trajectory, the answering turn included"))
    max_calls_per_turn: int = field(default=4, validator=_positive, metadata=doc("calculator calls evaluated per turn"))
    max_expression_chars: int = field(default=200, validator=_positive, metadata=doc("longer calculator expressions are refused"))
    max_exponent: int = field(default=64, validator=_positive, metadata=doc("largest |exponent| the calculator accepts"))
    max_result_digits: int = field(default=64, validator=_positive, metadata=doc("largest number of digits of any intermediate value"))


@frozen
class MathFilesDatasetConfig:
    """Math problems from local JSONL/JSON/Parquet files, directories written by
    ``datasets.save_to_disk``, or a Hugging Face hub dataset, loaded with ``datasets``."""

    name: Literal["math_jsonl"] = field(default="math_jsonl", metadata=doc("selects this dataset"))
    train_files: tuple[str, ...] = field(default=(), metadata=doc("training files (.jsonl, .json or .parquet) or datasets.save_to_disk directories"))
    validation_files: tuple[str, ...] = field(default=(), metadata=doc("held-out files or save_to_disk directories; empty = validation_split, else split validation_size off train"))
    hub_dataset: str | None = field(default=None, metadata=doc("Hugging Face hub dataset id (e.g. openai/gsm8k), used when train_files is empty; needs the hub or its local cache"))
    hub_subset: str | None = field(default=None, metadata=doc("the hub dataset's configuration (gsm8k: 'main')"))
    train_split: str = field(default="train", metadata=doc("split of hub_dataset (or of a saved DatasetDict) to train on"))
    validation_split: str | None = field(default=None, metadata=doc("held-out split of hub_dataset (or of a saved DatasetDict); None = none"))
    validation_size: int = field(default=0, validator=_non_negative, metadata=doc("rows split off train when validation_files is empty"))
    preset: Literal["gsm8k", "math", "deepscaler", "custom"] = field(
        default="gsm8k", metadata=doc("column layout: gsm8k (question/answer '#### n'), math (problem/solution \\boxed{}), deepscaler (problem/answer)"),
    )
    prompt_column: str | None = field(default=None, metadata=doc("column holding the problem; None = the preset's"))
    answer_column: str | None = field(default=None, metadata=doc("column holding the answer; None = the preset's"))
    response_column: str | None = field(default=None, metadata=doc("column holding a reference response, the sft algorithm's target (e.g. OpenMathInstruct-2's generated_solution); None = the answer column as written"))
    answer_extraction: Literal["preset", "hash", "boxed", "verbatim"] = field(
        default="preset", metadata=doc("how the ground truth is taken from the answer column ('#### n', last \\boxed{}, or as is)"),
    )
    prompt_template: str = field(
        default="{question}\nPlease reason step by step, and put your final answer within \\boxed{}.",
        metadata=doc("user message; '{question}' is replaced by the problem (no other braces are interpreted)"),
    )
    system_prompt: str | None = field(default=None, metadata=doc("optional system message"))
    chat_template: bool = field(default=True, metadata=doc("apply the tokenizer's chat template (instruct models); false encodes the system prompt and prompt text as is (base models)"))
    max_prompt_tokens: int | None = field(default=None, metadata=doc("prompts longer than this (after the chat template) are dropped and counted"))
    skip_bad_rows: bool = field(default=False, metadata=doc("skip and count malformed rows instead of stopping"))
    max_line_bytes: int = field(
        default=1 << 20, validator=_positive,
        metadata=doc("a JSONL line (or a .json or .parquet row) longer than this is an error naming the file and line, found before any parsing"),
    )
    decode_errors: Literal["error", "replace"] = field(
        default="error", metadata=doc("bytes that are not UTF-8: an error naming the file and line, or replaced by U+FFFD and counted"),
    )
    max_samples: int | None = field(default=None, metadata=doc("use only the first N training rows"))
    cache_dir: str | None = field(default=None, metadata=doc("Hugging Face datasets cache; None = its default"))
    seed: int = field(default=0, metadata=doc("seed of the train/validation split"))

    def __attrs_post_init__(self):
        if not self.train_files and not self.hub_dataset:
            raise ConfigError("data.train_files", "at least one training file (or data.hub_dataset) is required")
        if self.train_files and self.hub_dataset:
            raise ConfigError("data.hub_dataset", "give either data.train_files or data.hub_dataset, not both")
        if self.preset == "custom" and (self.prompt_column is None or self.answer_column is None):
            raise ConfigError("data.preset", "'custom' needs data.prompt_column and data.answer_column")
        if "{question}" not in self.prompt_template:
            raise ConfigError("data.prompt_template", "must contain '{question}'")


@frozen
class ArithmeticDatasetConfig:
    """Synthetic, seeded arithmetic problems ("12+7=") with a held-out split, for the tiny CPU demo."""

    name: Literal["arithmetic"] = field(default="arithmetic", metadata=doc("selects this dataset"))
    level: int | None = field(
        default=None, metadata=doc("difficulty preset 1-5 (sets digits, operations, num_terms); None = use those keys"),
    )
    digits: int = field(default=2, validator=[_positive, attrs.validators.le(9)], metadata=doc("operands have up to this many digits"))
    operations: tuple[str, ...] = field(default=("+",), metadata=doc("operators drawn from + - *"))
    num_terms: int = field(default=2, validator=[attrs.validators.ge(2), attrs.validators.le(8)], metadata=doc("operands per problem (3+ = multi-step)"))
    allow_negative: bool = field(default=False, metadata=doc("allow problems whose result is negative"))
    num_train: int = field(default=10_000, validator=_positive, metadata=doc("training problems (repeats allowed)"))
    num_validation: int = field(default=256, validator=_non_negative, metadata=doc("held-out problems, distinct, never in train"))
    seed: int = field(default=0, metadata=doc("generation seed"))
    prompt_template: str = field(default="{expr}=", metadata=doc("user message; '{expr}' is replaced by the expression"))
    system_prompt: str | None = field(default=None, metadata=doc("optional system message"))
    chat_template: bool = field(default=True, metadata=doc("apply the tokenizer's chat template (else encode the prompt text as is)"))

    def __attrs_post_init__(self):
        bad = [op for op in self.operations if op not in ARITHMETIC_OPERATIONS]
        if bad or not self.operations:
            raise ConfigError("data.operations", f"must be a non-empty list of {list(ARITHMETIC_OPERATIONS)}, got {list(self.operations)}")
        if self.level is not None:
            if self.level not in ARITHMETIC_LEVELS:
                raise ConfigError("data.level", f"must be one of {sorted(ARITHMETIC_LEVELS)} or null, got {self.level}")
            defaults = {f.name: f.default for f in attrs.fields(type(self)) if f.name in ("digits", "operations", "num_terms")}
            changed = [name for name, default in defaults.items() if getattr(self, name) != default]
            if changed:
                raise ConfigError("data.level", f"sets digits, operations and num_terms itself; remove data.{changed[0]} or data.level")
        if "{expr}" not in self.prompt_template:
            raise ConfigError("data.prompt_template", "must contain '{expr}'")

    def resolved(self) -> tuple[int, tuple[str, ...], int]:
        """(digits, operations, num_terms), from ``level`` when set."""
        if self.level is not None:
            return ARITHMETIC_LEVELS[self.level]
        return self.digits, tuple(self.operations), self.num_terms


# level -> (digits, operations, num_terms)
ARITHMETIC_LEVELS: dict[int, tuple[int, tuple[str, ...], int]] = {
    1: (1, ("+",), 2),
    2: (2, ("+",), 2),
    3: (2, ("+", "-"), 2),
    4: (2, ("+", "-", "*"), 3),
    5: (3, ("+", "-", "*"), 4),
}
