"""Reference decoder-only GPT: GPT-2 by default, the Llama family through Megatron's switches.

The forward pass has no host syncs and no data-dependent shapes, so a full training iteration
can be captured in a CUDA graph or compiled with ``torch.compile``. Blocks live in
``stalwart.models.blocks``, the config in ``stalwart.models.config``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.blocks import TransformerBlock, make_norm
from stalwart.models.config import GPTConfig
from stalwart.models.functional import rotary_tables
from stalwart.models.fused_cross_entropy import linear_cross_entropy
from stalwart.models.fused_grad import Linear, embedding_accumulating, linear_accumulating
from stalwart.models.moe import MoEMLP, MoERouter
from stalwart.models.recompute import layer_units, recomputed

__all__ = ["GPT", "rope_tables"]


def rope_tables(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE ``(cos, sin)`` tables of ``config`` (its base and Llama 3.x scaling)."""
    factor = config.rope_scaling_factor if config.use_rope_scaling else None
    return rotary_tables(config.kv_channels, config.seq_length, config.rotary_base, factor)


class GPT(nn.Module):
    """Decoder-only GPT language model.

    ``forward(input_ids)`` returns logits ``[b, s, vocab_size]`` (model dtype).
    ``forward(input_ids, labels)`` returns a dict of tensors:

    * ``"loss"``: scalar to backprop = lm loss + ``moe_aux_loss_coeff`` * (sum over MoE layers of
      each layer's load-balancing loss), as Megatron adds one aux term per layer;
    * ``"lm loss"``: detached mean token cross entropy, computed on fp32 logits; labels equal to
      -100 are ignored (a batch with every label ignored gives NaN);
    * MoE only: ``"load balancing loss"``: detached per-layer mean of the aux loss
      (``num_experts * sum_i f_i * P_i``; 1.0 for perfectly balanced routing).

    Initialization is deterministic given torch's global seed: every weight ~ N(0, init_std),
    residual output projections ~ N(0, init_std / sqrt(2 * num_layers)), biases 0, norms 1/0.
    Learned positions are ``position_embeddings``; RoPE tables are non-persistent buffers (not in
    the state dict). The untied output layer is ``output_layer.weight`` (Megatron's name).

    Example (a tiny Llama-style model with full recompute)::

        >>> cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
        ...                 vocab_size=64, position_embedding_type="rope", normalization="RMSNorm",
        ...                 swiglu=True, untie_embeddings_and_output_weights=True,
        ...                 add_bias_linear=False, num_query_groups=2,
        ...                 recompute_granularity="full", recompute_method="uniform",
        ...                 recompute_num_layers=1)
        >>> ids = torch.zeros(2, 8, dtype=torch.long)
        >>> GPT(cfg)(ids, ids)["loss"].backward()
    """

    rope_cos: torch.Tensor | None
    rope_sin: torch.Tensor | None
    # The output layer's weight for tied embeddings while bf16 compute weights are swapped in
    # (``stalwart.loop.ComputeWeights``); None: the word embeddings' own (fp32) weight.
    output_compute_weight: torch.Tensor | None = None
    # Gradient accumulation fusion (``stalwart.models.fused_grad``), set by ComputeWeights for
    # one micro-batch: the fp32 gradients the tied output layer's and the lookup's gradients
    # are added into (None: the plain ops).
    output_compute_weight_main_grad: torch.Tensor | None = None
    embedding_main_grad: torch.Tensor | None = None
    fp32_wgrad: bool = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings: nn.Embedding | None = None
        if config.uses_rope:
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.position_embeddings = nn.Embedding(config.seq_length, h)
            self.rope_cos = self.rope_sin = None
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = make_norm(config)
        self.output_layer: Linear | None = None
        if config.untie_embeddings_and_output_weights:
            self.output_layer = Linear(h, config.vocab_size, bias=False)
        self._units = layer_units(config)
        self._init_weights()

    @classmethod
    def for_loading(cls, config: GPTConfig, device: torch.device | str) -> GPT:
        """The model on ``device`` with every weight zero, for a checkpoint load to fill.

        A resume overwrites every weight, so it skips the random initialisation and the copy to
        the device (at gpt2-124m, over a second of every restart). The non-persistent buffers,
        which no checkpoint holds, are what ``GPT(config)`` gives: the RoPE tables, zero MoE
        counters.

            >>> cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
            ...                 seq_length=8, vocab_size=32, position_embedding_type="rope")
            >>> blank, fresh = GPT.for_loading(cfg, "cpu"), GPT(cfg)
            >>> bool(blank.word_embeddings.weight.abs().sum() == 0)
            True
            >>> torch.equal(blank.rope_cos, fresh.rope_cos)
            True
        """
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                tensor.zero_()
            if model.rope_cos is not None and model.rope_sin is not None:
                cos, sin = rope_tables(config)
                model.rope_cos.copy_(cos)
                model.rope_sin.copy_(sin)
        return model

    def _init_weights(self) -> None:
        std = self.config.init_std
        residual_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if (".ln" in name or name.startswith("final_layernorm")) and leaf == "weight":
                nn.init.ones_(param)
            elif leaf == "bias" or leaf.endswith("_bias"):
                nn.init.zeros_(param)
            elif name.endswith(("proj.weight", "fc2.weight", "fc2_weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Run the model on int64 ``input_ids`` [b, s] (s <= seq_length); see class docstring."""
        if input_ids.dim() != 2 or input_ids.shape[1] > self.config.seq_length:
            raise ValueError(
                f"input_ids must be [batch, s] with s <= --seq-length={self.config.seq_length}, "
                f"got shape {tuple(input_ids.shape)}"
            )
        if self.embedding_main_grad is None:
            x = self.word_embeddings(input_ids)
        else:
            x = embedding_accumulating(
                input_ids, self.word_embeddings.weight, self.embedding_main_grad
            )
        if self.position_embeddings is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.position_embeddings(positions)
        if self.config.bf16_residual_connection:
            x = x.to(torch.bfloat16)
        x, aux_losses = self._run_layers(self.embedding_dropout(x))
        x = self.final_layernorm(x)
        if labels is None:
            return self._logits(x)
        lm_loss = self._loss(x, labels)
        out = {"lm loss": lm_loss.detach()}
        if aux_losses:
            aux_sum = torch.stack(aux_losses).sum()
            out["loss"] = lm_loss + self.config.moe_aux_loss_coeff * aux_sum
            out["load balancing loss"] = (aux_sum / len(aux_losses)).detach()
        else:
            out["loss"] = lm_loss
        return out

    def _loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross entropy (fp32) of the output layer on ``x``. Fused
        (``cross_entropy_loss_fusion``) only where a backward follows: without one the forward
        would write a gradient nobody reads."""
        if not (self.config.cross_entropy_loss_fusion and torch.is_grad_enabled()):
            logits = self._logits(x)
            return F.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
            )
        if self.output_layer is not None:
            target, fp32 = self.output_layer.weight_main_grad, self.output_layer.fp32_wgrad
        else:
            target, fp32 = self.output_compute_weight_main_grad, self.fp32_wgrad
        weight = self._output_weight()
        return linear_cross_entropy(x, weight, labels, main_grad=target, fp32_wgrad=fp32)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer(x)
        target = self.output_compute_weight_main_grad
        if target is None:
            return F.linear(x, self._output_weight())
        return linear_accumulating(x, self._output_weight(), None, target, self.fp32_wgrad)

    def fused_grad_direct_uses(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """The uses of a parameter outside ``compute_weight_slots()`` that can add their
        gradient into its fp32 ``.grad`` themselves (gradient accumulation fusion): the word
        embeddings' lookup, through ``embedding_main_grad`` (its rows are added in place of a
        dense ``[vocab, hidden]`` gradient). ``(module, attribute, parameter)``:
        ``ComputeWeights`` sets ``module.<attribute>`` to the parameter's ``.grad`` for each
        micro-batch."""
        weight: nn.Parameter = self.word_embeddings.weight  # type: ignore[assignment]
        return [(self, "embedding_main_grad", weight)]

    def _output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        tied = self.output_compute_weight
        return tied if tied is not None else self.word_embeddings.weight

    def compute_weight_slots(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Where bf16 compute weights go (``stalwart.loop.ComputeWeights``): the weight and bias
        of every Linear (attention, dense MLP, untied output layer) and the MoE experts' stacked
        weights and biases (autocast runs all of these in bf16), and for tied embeddings the
        output layer's use of them through ``output_compute_weight`` (the lookup keeps the fp32
        weight). The MoE router stays fp32 (it runs outside autocast)."""
        slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        for module in self.modules():
            if isinstance(module, nn.Linear | MoEMLP):
                slots += [(module, n, p) for n, p in module.named_parameters(recurse=False)]
        if self.output_layer is None:
            tied: nn.Parameter = self.word_embeddings.weight  # type: ignore[assignment]
            slots.append((self, "output_compute_weight", tied))
        return slots

    def fp32_grad_slots(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Parameters that stay fp32 under autocast but whose per-micro-batch gradient
        accumulation goes through ``ComputeWeights``' one foreach add with the bf16 copies'
        (fp32 copies, swapped in the same way): every norm's weight and bias and the learned
        position embeddings. The word embeddings stay direct (their lookup gradient is a dense
        ``[vocab, hidden]`` tensor either way)."""
        slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        for module in self.modules():
            if isinstance(module, nn.LayerNorm | nn.RMSNorm):
                slots += [(module, n, p) for n, p in module.named_parameters(recurse=False)]
        if self.position_embeddings is not None:
            table = self.position_embeddings
            slots.append((table, "weight", table.weight))  # type: ignore[arg-type]
        return slots

    def _run_layers(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layers, unit by unit; a recomputed unit keeps only its input for backward."""
        aux_losses: list[torch.Tensor] = []
        preserve_rng = self.config.dropout > 0.0
        for unit in self._units:
            if unit.recompute:
                outputs = recomputed(
                    self._run_unit, x, unit.start, unit.stop, preserve_rng_state=preserve_rng
                )
            else:
                outputs = self._run_unit(x, unit.start, unit.stop)
            x = outputs[0]
            aux_losses.extend(outputs[1:])
        return x, aux_losses

    def _run_unit(self, x: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Layers ``[start, stop)``: ``(hidden states, *MoE aux losses)``."""
        rope = None
        if self.rope_cos is not None and self.rope_sin is not None:
            rope = (self.rope_cos, self.rope_sin)
        aux_losses: list[torch.Tensor] = []
        for index in range(start, stop):
            x, aux = self.layers[index](x, rope)
            if aux is not None:
                aux_losses.append(aux)
        return (x, *aux_losses)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameter count (tied weights once); optionally without the embeddings
        (word, learned position, untied output layer)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            embeddings = [self.word_embeddings, self.position_embeddings, self.output_layer]
            total -= sum(m.weight.numel() for m in embeddings if m is not None)
        return total

    def moe_routers(self) -> list[tuple[str, MoERouter]]:
        """``(qualified name, router)`` for every MoE router, in layer order (empty when dense)."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, MoERouter)]
