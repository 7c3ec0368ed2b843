"""``GPTConfig``: the reference model's hyper-parameters and their validation.

Architecture switches follow Megatron's spelling: GPT-2 (learned positions, LayerNorm, GELU, tied
embeddings, biases) by default; ``position_embedding_type=rope``, ``normalization=RMSNorm``,
``swiglu``, ``untie_embeddings_and_output_weights``, ``add_bias_linear=False`` and
``num_query_groups`` give the Llama family. Activation recompute (``recompute_granularity``,
``recompute_method``, ``recompute_num_layers``) has Megatron's meanings; see
``stalwart.models.recompute``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar


class PositionEmbeddingType(enum.Enum):
    """``--position-embedding-type``."""

    LEARNED_ABSOLUTE = "learned_absolute"
    ROPE = "rope"


class Normalization(enum.Enum):
    """``--normalization`` (Megatron spells the values in CamelCase)."""

    LAYER_NORM = "LayerNorm"
    RMS_NORM = "RMSNorm"


class RecomputeGranularity(enum.Enum):
    """``--recompute-granularity``: off, the attention core only, or whole layers."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class RecomputeMethod(enum.Enum):
    """``--recompute-method`` (full granularity only).

    ``UNIFORM``: the layers are split into groups of ``--recompute-num-layers``; each group keeps
    only its input and is recomputed as a whole. ``BLOCK``: the first ``--recompute-num-layers``
    layers are recomputed one by one, the rest keep their activations.
    """

    UNIFORM = "uniform"
    BLOCK = "block"


_E = TypeVar("_E", bound=enum.Enum)


def _as_enum(value: object, cls: type[_E], flag: str, allowed: tuple[str, ...]) -> _E:
    if isinstance(value, cls):
        return value
    for member in cls:
        if isinstance(value, str) and value == member.value and value in allowed:
            return member
    raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")


def _require_int(value: object, flag: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def _require_bool(value: object, flag: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{flag} is a switch (true or false), got {value!r}")


def _require_positive(value: object, flag: str) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not value > 0.0 or value == float("inf"):  # type: ignore[operator]
        raise ValueError(f"{flag} must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Model hyper-parameters; validated on construction (``ValueError`` naming the flag).

    ``ffn_hidden_size=None`` resolves to ``4 * hidden_size``. ``num_experts=0`` means a dense MLP;
    otherwise every layer's MLP is a top-``moe_router_topk`` mixture of ``num_experts`` experts with
    per-expert capacity ``ceil(moe_capacity_factor * topk * tokens / num_experts)``
    (``moe_capacity_factor=None``: no dropping). One ``dropout`` is used for embeddings,
    attention probabilities and residual branches (flag ``--hidden-dropout``).

    ``num_query_groups=None`` is multi-head attention (one key/value head per query head); a value
    that divides ``num_attention_heads`` is grouped-query attention. With ``swiglu`` the first MLP
    layer produces ``2 * ffn_hidden_size`` (gate and up) and the MLP has ``3 * h * ffn`` weights.
    Enum fields also accept their string values (``"rope"``, ``"RMSNorm"``, ``"full"``), so a
    config read back from JSON builds the same model.

    Example::

        >>> cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
        ...                 vocab_size=128, position_embedding_type="rope", num_query_groups=2)
        >>> cfg.position_embedding_type, cfg.query_groups, cfg.kv_channels
        (<PositionEmbeddingType.ROPE: 'rope'>, 2, 16)
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    dropout: float = 0.0
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2
    moe_capacity_factor: float | None = 1.25
    init_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    # Llama switches (Megatron names).
    position_embedding_type: PositionEmbeddingType = PositionEmbeddingType.LEARNED_ABSOLUTE
    rotary_base: int = 10000
    # Llama 3.x frequency scaling of RoPE (Megatron's --use-rope-scaling, --rope-scaling-factor):
    # wavelengths past 8192 tokens are divided by the factor, those under 2048 kept, those
    # between blended (low/high frequency factors 1 and 4, as Llama 3.1 and 3.2).
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    normalization: Normalization = Normalization.LAYER_NORM
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    num_query_groups: int | None = None
    # Activation recompute (Megatron names and meanings).
    recompute_granularity: RecomputeGranularity = RecomputeGranularity.NONE
    recompute_method: RecomputeMethod | None = None
    recompute_num_layers: int | None = None
    # Keep the residual stream (embeddings, every block's output) in bf16 instead of fp32 under
    # bf16 autocast: half the residual traffic and saved residuals (Megatron's default under
    # --bf16; its --fp32-residual-connection is this switch off). Needs bf16 autocast.
    bf16_residual_connection: bool = False
    # The output layer and the cross entropy as one op whose forward writes the loss's gradient
    # over the logits (Megatron's --cross-entropy-loss-fusion; stalwart.models.fused_cross_entropy).
    cross_entropy_loss_fusion: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        self._coerce_enums()
        self.validate()

    def _coerce_enums(self) -> None:
        """Accept enum values as strings (CLI, TOML, a config saved as JSON)."""
        set_ = object.__setattr__
        set_(
            self,
            "position_embedding_type",
            _as_enum(
                self.position_embedding_type,
                PositionEmbeddingType,
                "--position-embedding-type",
                ("learned_absolute", "rope"),
            ),
        )
        set_(
            self,
            "normalization",
            _as_enum(
                self.normalization, Normalization, "--normalization", ("LayerNorm", "RMSNorm")
            ),
        )
        granularity: Any = self.recompute_granularity
        set_(
            self,
            "recompute_granularity",
            _as_enum(
                "none" if granularity is None else granularity,
                RecomputeGranularity,
                "--recompute-granularity",
                ("full", "selective", "none"),
            ),
        )
        if self.recompute_method is not None:
            set_(
                self,
                "recompute_method",
                _as_enum(
                    self.recompute_method,
                    RecomputeMethod,
                    "--recompute-method",
                    ("uniform", "block"),
                ),
            )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the Megatron flag of the first invalid field."""
        self._validate_shapes()
        self._validate_moe()
        self._validate_llama()
        self._validate_recompute()

    def _validate_shapes(self) -> None:
        _require_int(self.num_layers, "--num-layers", 1)
        _require_int(self.hidden_size, "--hidden-size", 1)
        _require_int(self.num_attention_heads, "--num-attention-heads", 1)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must divide "
                f"--hidden-size ({self.hidden_size})"
            )
        _require_int(self.seq_length, "--seq-length", 1)
        _require_int(self.vocab_size, "--vocab-size", 1)
        _require_int(self.ffn_hidden_size, "--ffn-hidden-size", 1)
        dropout: Any = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, int | float):
            raise ValueError(f"--hidden-dropout must be a number in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"--hidden-dropout must be in [0, 1), got {dropout!r}")
        _require_positive(self.init_std, "--init-method-std")
        _require_positive(self.layernorm_epsilon, "--norm-epsilon")

    def _validate_moe(self) -> None:
        _require_int(self.num_experts, "--num-experts", 0)
        if self.num_experts > 0:
            if isinstance(self.moe_router_topk, bool) or not isinstance(self.moe_router_topk, int):
                raise ValueError(
                    f"--moe-router-topk must be an integer, got {self.moe_router_topk!r}"
                )
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"--moe-router-topk must be in [1, --num-experts={self.num_experts}], "
                    f"got {self.moe_router_topk}"
                )
        if not self.moe_aux_loss_coeff >= 0.0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff!r}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0.0:
            raise ValueError(
                "--moe-expert-capacity-factor must be > 0 or None (no dropping), "
                f"got {self.moe_capacity_factor!r}"
            )

    def _validate_llama(self) -> None:
        for flag, value in (
            ("--swiglu", self.swiglu),
            ("--untie-embeddings-and-output-weights", self.untie_embeddings_and_output_weights),
            ("--disable-bias-linear", self.add_bias_linear),
            ("--use-rope-scaling", self.use_rope_scaling),
            ("--bf16-residual-connection", self.bf16_residual_connection),
            ("--cross-entropy-loss-fusion", self.cross_entropy_loss_fusion),
        ):
            _require_bool(value, flag)
        _require_int(self.rotary_base, "--rotary-base", 1)
        _require_positive(self.rope_scaling_factor, "--rope-scaling-factor")
        if self.use_rope_scaling and not self.uses_rope:
            raise ValueError("--use-rope-scaling needs --position-embedding-type rope")
        if self.num_query_groups is not None:
            _require_int(self.num_query_groups, "--num-query-groups", 1)
            if self.num_attention_heads % self.num_query_groups != 0:
                raise ValueError(
                    f"--num-query-groups ({self.num_query_groups}) must divide "
                    f"--num-attention-heads ({self.num_attention_heads})"
                )
        if self.position_embedding_type is PositionEmbeddingType.ROPE and self.kv_channels % 2:
            raise ValueError(
                "--position-embedding-type rope needs an even head dimension "
                f"(--hidden-size / --num-attention-heads = {self.kv_channels})"
            )

    def _validate_recompute(self) -> None:
        granularity, method, count = (
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
        )
        if granularity is not RecomputeGranularity.FULL:
            if method is not None:
                raise ValueError(
                    f"--recompute-method {method.value} requires --recompute-granularity full "
                    f"(got {granularity.value})"
                )
            if count is not None:
                raise ValueError(
                    "--recompute-num-layers requires --recompute-granularity full "
                    f"(got {granularity.value})"
                )
            return
        if method is None:
            raise ValueError(
                "--recompute-granularity full requires --recompute-method uniform or block"
            )
        if count is None:
            raise ValueError(
                "--recompute-granularity full requires --recompute-num-layers "
                f"(1 to --num-layers={self.num_layers})"
            )
        if (
            isinstance(count, bool)
            or not isinstance(count, int)
            or not 1 <= count <= self.num_layers
        ):
            raise ValueError(
                "--recompute-num-layers must be an integer in [1, "
                f"--num-layers={self.num_layers}], "
                f"got {count!r}"
            )
        if method is RecomputeMethod.UNIFORM and self.num_layers % count:
            raise ValueError(
                f"--recompute-method uniform needs --recompute-num-layers ({count}) to divide "
                f"--num-layers ({self.num_layers})"
            )

    @property
    def ffn_size(self) -> int:
        """The resolved MLP hidden size (``ffn_hidden_size`` or ``4 * hidden_size``)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_channels(self) -> int:
        """Head dimension (``hidden_size / num_attention_heads``)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or ``num_attention_heads`` without GQA."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def uses_rope(self) -> bool:
        return self.position_embedding_type is PositionEmbeddingType.ROPE
