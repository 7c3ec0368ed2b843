"""torchtitan 0.3.0's peers of ``bench/peers.py`` (each runs in its own child, on CUDA).

``run_trainer``: torchtitan's own ``Trainer``, configured as its Llama 3 recipes are, for one GPU
at its fastest documented bf16 settings: ``compile.enable`` on the model and the loss, its fwd+bwd
CUDA graph (``training.disable_cuda_graphs=False``, the default), no activation checkpointing
(``activation_checkpoint=None``; the model fits), the chunked cross entropy of its recipes, fused
AdamW, bf16 parameters over fp32 masters (``mixed_precision_param``, through FSDP2's
``MixedPrecisionPolicy`` on a one-rank mesh), its default ``flex`` attention with per-document
positions. The data loader and tokenizer slots get synthetic ones (``Configurable`` subclasses,
torchtitan's extension point): the same uint32 token windows as the other peers.

torchtitan 0.3.0 was built against a later torch than 2.11: its ``full_dtensor`` module (imported
by the trainer and by ``parallelize_llama``) imports ``torch.distributed.fsdp.DataParallelMeshDims``,
which torch 2.11 lacks. The import error is recorded as it is; then a stand-in dataclass is
defined for that name (torchtitan builds one only for a multi-axis FSDP mesh, never on one GPU)
and the trainer is tried again, its row naming the stand-in. Where the trainer still cannot run,
``bench/peers.py`` starts ``run_fallback`` in a fresh process: torchtitan's model, its own
``parallelize_llama`` (``apply_compile`` per block, FSDP2 mixed precision) and the training step
of its ``Trainer.train_step`` (forward, chunked loss, backward, clip, fused AdamW, LR step)
without the fwd+bwd CUDA graph, on the ``partial_dtensor`` backend (no spmd_types typing on one
rank).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from peer_common import Clock, Spec, TokenWindows, model_config

ROPE_CACHE = 131072  # torchtitan's Llama 3 flavors' max_seq_len


def torch_stand_ins() -> list[str]:
    """Define what torchtitan 0.3.0 imports from torch and this torch lacks; the names."""
    import torch.distributed.fsdp as fsdp

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:  # the fields of the later torch's class
            shard: str | tuple[str, ...] | None = None
            replicate: str | None = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims  # type: ignore[attr-defined]
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    return added


def _import(name: str, notes: dict[str, Any]) -> Any:
    """``import name``; on an ImportError its message goes into ``notes`` and the import is
    tried once more after :func:`torch_stand_ins` (an error then names both)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        first = f"{type(exc).__name__}: {exc}"
        notes["import_error"] = first
        print(f"torchtitan does not import on torch {torch.__version__}: {first}", flush=True)
        added = torch_stand_ins()
        if not added:
            raise
        notes["stand_ins"] = added
        for module in [m for m in sys.modules if m.startswith(("torchtitan", "spmd_types"))]:
            del sys.modules[module]  # partly imported before the error
        try:
            return importlib.import_module(name)
        except ImportError as again:
            raise ImportError(
                f"{first}; with a stand-in for {', '.join(added)}: {again}"
            ) from again


def _single_process_env() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))


def titan_model(cfg: Any) -> tuple[Any, dict[str, Any]]:
    """torchtitan's Llama 3 config of ``cfg``'s shape, built as its flavors are (its ``1B``
    flavor's structure and inits); notes on how it relates to the ``1B`` flavor."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _EMBEDDING_SKIP_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
        llama3_configs,
    )
    from torchtitan.models.llama3.model import Llama3Model

    dim, vocab, tied = cfg.hidden_size, cfg.vocab_size, not cfg.untie_embeddings_and_output_weights
    rope = ComplexRoPE.Config(
        dim=cfg.kv_channels,
        max_seq_len=ROPE_CACHE,
        theta=float(cfg.rotary_base),
        scaling="llama" if cfg.use_rope_scaling else "none",
        scaling_factor=float(cfg.rope_scaling_factor),
    )
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)
        ),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=cfg.num_layers,
            dim=dim,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.query_groups,
            hidden_dim=cfg.ffn_size,
            rope=rope,
            attn_backend="flex",
        ),
    )
    notes: dict[str, Any] = {}
    flavor = llama3_configs["1B"](attn_backend="flex")
    if (dim, vocab, len(config.layers)) == (flavor.dim, flavor.vocab_size, len(flavor.layers)):
        for _, rope_cfg, _, _ in flavor.traverse(ComplexRoPE.Config):
            rope_cfg.scaling_factor = rope.scaling_factor  # the one known difference
        same = _comparable(config.to_dict()) == _comparable(flavor.to_dict())
        notes["vs_1B_flavor"] = (
            f"torchtitan's 1B flavor, but RoPE scaling factor {cfg.rope_scaling_factor} "
            "(Llama 3.2 1B's) where the flavor has 8.0"
            if same
            else "DIFFERS from torchtitan's 1B flavor beyond the RoPE scaling factor"
        )
    return config, notes


def _comparable(value: Any) -> Any:
    """A config dict with the init functions' addresses dropped (their reprs differ per build)."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_comparable(v) for v in value]
    return re.sub(r" at 0x[0-9a-f]+", "", value) if isinstance(value, str) else value


def _spec(cfg: Any) -> tuple[Any, dict[str, Any]]:
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec

    model, notes = titan_model(cfg)
    spec = ModelSpec(
        name="llama3",
        flavor="peers",
        model=model,
        parallelize_fn=parallelize_llama,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
    return spec, notes


def _synthetic_components(tokens_path: str) -> tuple[Any, Any]:
    """Tokenizer and data loader configs for torchtitan's slots: the token file's windows as
    ``({"input": ids, "positions": 0..s-1}, labels)``, one document per sample."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer

    class SyntheticTokenizer(BaseTokenizer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Config, **_: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("synthetic tokens")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("synthetic tokens")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class Windows(TokenWindows):
        def __getitem__(self, index: int) -> Any:  # type: ignore[override]
            w = self.window(index)
            return {"input": w[:-1], "positions": torch.arange(self.seq)}, w[1:]

    class SyntheticLoader(ParallelAwareDataloader):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            tokens_path: str = ""

        def __init__(
            self,
            config: Config,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            **_: Any,
        ) -> None:
            super().__init__(
                Windows(config.tokens_path, seq_len),
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                batch_size=local_batch_size,
            )

    return SyntheticTokenizer.Config, SyntheticLoader.Config(tokens_path=tokens_path)


def run_trainer(spec: Spec, clock: Clock) -> dict[str, Any]:
    """torchtitan's ``Trainer`` (see the module docstring)."""
    if spec.device != "cuda":
        raise RuntimeError("torchtitan's trainer needs CUDA (its device is torch.cuda's)")
    notes: dict[str, Any] = {}
    tt = _import("torchtitan.trainer", notes)
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig

    cfg = model_config(spec)
    model_spec, model_notes = _spec(cfg)
    tokenizer, loader = _synthetic_components(spec.tokens_path)
    config = tt.Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=spec.work_dir,
        dump_folder=str(Path(spec.work_dir) / "torchtitan"),
        tokenizer=tokenizer(vocab_size=cfg.vocab_size),
        dataloader=loader,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size)
        ),
        optimizer=default_adamw(lr=spec.lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine"),
        training=TrainingConfig(
            local_batch_size=spec.micro_batch_size,
            global_batch_size=spec.global_batch_size,
            seq_len=cfg.seq_length,
            steps=spec.total_iterations,
        ),
        compile=CompileConfig(enable=spec.compile, components=["model", "loss"]),
        activation_checkpoint=None,
        metrics=MetricsProcessor.Config(log_freq=spec.log_interval),
    )

    class TimedTrainer(tt.Trainer):  # type: ignore[misc,name-defined]
        def train_step(self, data_iterator: Any) -> None:
            clock.before(self.step)
            super().train_step(data_iterator)
            clock.after(self.step)

    _single_process_env()
    trainer = TimedTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    import torchtitan

    stand = notes.get("stand_ins")
    mode = f"torchtitan {getattr(torchtitan, '__version__', '?')} Trainer"
    if stand:
        mode += f" (with a stand-in for {', '.join(stand)})"
    return {"mode": mode, **notes, **model_notes}


def run_fallback(spec: Spec, clock: Clock) -> dict[str, Any]:
    """torchtitan's model + ``parallelize_llama`` + its training step (module docstring)."""
    notes: dict[str, Any] = {}
    _import("torchtitan.models.llama3", notes)
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    cfg = model_config(spec)
    device = torch.device(spec.device)
    _single_process_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist_utils.init_distributed(CommConfig(), base_folder=spec.work_dir)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world_size=1)
    training = TrainingConfig(
        local_batch_size=spec.micro_batch_size,
        global_batch_size=spec.global_batch_size,
        seq_len=cfg.seq_length,
        steps=spec.total_iterations,
    )
    compile_config = CompileConfig(enable=spec.compile, components=["model", "loss"])
    model_cfg, model_notes = titan_model(cfg)
    with torch.device("meta"):
        model = model_cfg.build()
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=None,
        dump_folder=spec.work_dir,
    )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size)
    ).build(compile_config=compile_config)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = default_adamw(lr=spec.lr).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine").build(
        optimizers=optimizers, training_steps=spec.total_iterations
    )
    context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
    step = _FallbackStep(model, loss_fn, optimizers, schedulers, context, spec, cfg.seq_length)
    try:
        for i in range(1, spec.total_iterations + 1):
            clock.before(i)
            step(i)
            clock.after(i)
    finally:
        torch.distributed.destroy_process_group()
    return {
        "mode": "torchtitan 0.3.0 model + parallelize_llama (compile per block, FSDP2 bf16) "
        "+ its train_step, no fwd+bwd CUDA graph",
        **notes,
        **model_notes,
    }


class _FallbackStep:
    """``Trainer.train_step`` of torchtitan 0.3.0 for one rank without pipeline parallelism."""

    def __init__(
        self,
        model: Any,
        loss_fn: Any,
        optimizers: Any,
        schedulers: Any,
        context: Any,
        spec: Spec,
        seq: int,
    ) -> None:
        self.model, self.loss_fn, self.context = model, loss_fn, context
        self.optimizers, self.schedulers, self.spec = optimizers, schedulers, spec
        self.windows = TokenWindows(spec.tokens_path, seq)
        self.device = torch.device(spec.device)
        self.params = [p for p in model.parameters()]

    def _batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mbs = self.spec.micro_batch_size
        w = torch.stack([self.windows.window(index * mbs + k) for k in range(mbs)])
        positions = torch.arange(self.windows.seq).expand(mbs, -1)
        return w[:, :-1].to(self.device), positions.to(self.device), w[:, 1:].to(self.device)

    def __call__(self, i: int) -> None:
        from torchtitan.distributed import utils as dist_utils

        self.optimizers.zero_grad()
        n = self.spec.num_microbatches
        batches = [self._batch((i - 1) * n + k) for k in range(n)]
        valid = sum(int(labels.numel()) for _, _, labels in batches)  # no ignored labels
        global_valid_tokens = torch.tensor(valid, device=self.device)
        for inputs, positions, labels in batches:
            with self.context():
                masks = self.model.get_attention_masks(positions=positions)
                pred = self.model(inputs, positions=positions, attention_masks=masks)
                loss, _ = self.loss_fn(pred, labels, global_valid_tokens, positions=positions)
                del pred
                loss.backward()
        dist_utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.optimizers.step()
        self.schedulers.step()
