"""Does this run match the checkpoint it resumes from? Pure comparisons, flags named.

A checkpoint saved with other model shapes cannot be loaded: the user gets one line naming each
flag and both values before any tensor is read (instead of a DCP size-mismatch traceback deep in
the loader). Fields that do not change parameter shapes (dropout, init, MoE loss coefficient and
capacity, router top-k, epsilon, RoPE base, activation recompute) may change on purpose between
runs: they are reported, not refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# GPTConfig fields whose values fix parameter shapes (seq_length: learned position embeddings).
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "ffn_hidden_size",
    "num_experts",
    # Llama switches: each changes which parameters exist or their shapes.
    "num_query_groups",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "add_bias_linear",
    "normalization",
    "position_embedding_type",
)
# Flags whose spelling is not the field name.
_FLAG_OF = {
    "dropout": "--hidden-dropout",
    "add_bias_linear": "--disable-bias-linear",
    "layernorm_epsilon": "--norm-epsilon",
}


def flag_of(field_name: str) -> str:
    return _FLAG_OF.get(field_name, "--" + field_name.replace("_", "-"))


def model_config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """(refusals, notes): ``"--flag: checkpoint X, this run Y"`` for every differing field.

    Refusals are the shape fields; notes the rest. Fields missing on one side are ignored (older
    or newer checkpoints).
    """
    refusals: list[str] = []
    notes: list[str] = []
    for name in sorted(set(saved) & set(current)):
        if saved[name] == current[name]:
            continue
        line = f"{flag_of(name)}: checkpoint {saved[name]!r}, this run {current[name]!r}"
        (refusals if name in SHAPE_FIELDS else notes).append(line)
    return refusals, notes


def check_model_matches(
    common: Mapping[str, Any], current: Mapping[str, Any], log: Any = None
) -> None:
    """``ValueError`` naming every shape flag that differs from the checkpoint's ``common``
    (``common["config"]["model"]``); other differences go to ``log`` (a callable) if given."""
    saved = common.get("config", {}).get("model")
    if not isinstance(saved, Mapping):
        return  # a checkpoint without a recorded config: nothing to compare
    refusals, notes = model_config_differences(saved, current)
    if refusals:
        raise ValueError(
            "the checkpoint was saved with another model shape (pass the same flags, or start "
            "a new --save directory): " + "; ".join(refusals)
        )
    if notes and log is not None:
        log("resuming with changed model settings: " + "; ".join(notes))


def nothing_left_to_train(checkpoint: str | None, iteration: int, training: Any) -> str | None:
    """The exit detail when the checkpoint resumed from is already at or past the end of the run
    (``training``: the ``TrainingConfig``, ``--train-samples`` resolved to ``train_iters``);
    None when there is something to train. The run then exits 0 (reason ``finished``) saying so
    in one line instead of doing nothing silently."""
    end = training.train_iters
    if checkpoint is None or iteration < end:
        return None
    flag = (
        f"--train-samples {training.train_samples} ({end} iterations)"
        if training.train_samples is not None
        else f"--train-iters {end}"
    )
    where = "already at" if iteration == end else "already past"
    return (
        f"the checkpoint {checkpoint} is at iteration {iteration}, {where} {flag}: nothing to "
        f"train; pass a larger {flag.split()[0]} to train on"
    )


def upgrade_common_layout(common: dict[str, Any]) -> dict[str, Any]:
    """The reference trainer's common state in today's part names.

    Checkpoints of stalwart before the guarded step (``iteration`` and ``consumed_samples`` at
    the top, ``data`` = the sampler's state, ``loss_scaler``) become ``train_state``,
    ``data = {position, source}`` (position: micro-batches this rank consumed), ``step``.
    Today's layout is returned unchanged.
    """
    if "train_state" in common or "iteration" not in common:
        return common
    old = dict(common)
    sampler = old.pop("data", None)
    upgraded: dict[str, Any] = {
        "train_state": {
            "iteration": old.pop("iteration"),
            "consumed_samples": old.pop("consumed_samples", 0),
        },
        "step": {"loss_scaler": old.pop("loss_scaler", None) or {}},
    }
    if isinstance(sampler, Mapping):
        per_step = int(sampler.get("micro_batch_size", 1)) * int(sampler.get("dp_size", 1))
        consumed = int(sampler.get("consumed_samples", 0))
        upgraded["data"] = {"position": consumed // max(per_step, 1), "source": dict(sampler)}
    return {**upgraded, **old}
