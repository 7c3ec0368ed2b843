"""Tensor dumps: activations, dgrads, wgrads, params, tokens per expert and per-module statistics.

Usage in a hand-written loop::

    cfg = DumpConfig(save_activations_interval=100, save_dgrads_interval=100,
                     save_wgrads_interval=100, save_params_interval=100,
                     save_tokens_per_expert_interval=10, tensor_stats_interval=10)
    dumper = make_tensor_dumper(model, run_dir, cfg, rank=rank, dp_rank=dp_rank)
    for it in range(1, iters + 1):
        dumper.begin_iteration(it)                  # registers hooks only if `it` dumps anything
        for i, mb in enumerate(micro_batches):
            dumper.begin_microbatch(i, i == len(micro_batches) - 1)
            model(mb).loss.backward()
            dumper.end_microbatch()                 # tokens per expert; wgrads after the last
        clip_grads(); optimizer.step()
        dumper.end_iteration()                      # writes files (params after the step)
    dumper.close()

Files (iteration numbers are the caller's, zero-padded to 7 digits; ``.pt`` files hold a flat
``{key: cpu tensor}`` dict, the same format for every tensor dump):

* ``<dir>/activations/iter_0000010/rank{R}.pt``: ``{"<module>/input<i>"|"<module>/output<i>": cpu
  tensor}`` for every ``nn.Linear``, ``nn.Embedding`` and MoE router, last micro-batch only.
* ``<dir>/dgrads/iter_0000010/rank{R}.pt``: ``{"<module>/grad_input<i>"|"<module>/grad_output<i>"}``
  from full backward hooks, last micro-batch only, data-parallel replica 0 only.
* ``<dir>/wgrads/iter_0000010/rank{R}.pt``: ``{"<param name>": grad}`` (``--save-wgrads-interval``):
  each parameter's gradient after the last micro-batch's backward (accumulated over the
  micro-batches and averaged across data-parallel ranks, before clipping and the optimizer step,
  as Megatron's ``main_grad`` dump), data-parallel replica 0 only.
* ``<dir>/params/iter_0000010/rank{R}.pt``: ``{"<param name>": value}`` (``--save-params-interval``)
  after the optimizer step, data-parallel replica 0 only.
* ``<dir>/tokens_per_expert/rank{R}.jsonl``: Megatron's record schema, one line per MoE layer per
  dump iteration, sorted by layer: ``{"iter": 10, "block": "decoder", "layer": 3, "tpe": [[...],
  ...]}`` with one list of per-expert token counts **per micro-batch** (``tpe[m][e]``), read from
  each router's ``last_tokens_per_expert`` after every micro-batch (copied on the device, read
  once at the end of the iteration).
* ``<dir>/tensor_stats/rank{R}.jsonl``: one line per stats iteration ``{"iteration", "modules":
  {name: {"mean", "std", "absmax", "nonfinite"}}}`` over each module's outputs in the last
  micro-batch. Computed on device into one preallocated ``[modules, 4]`` buffer; read once.

Cost: nothing on iterations that dump nothing (no hooks are registered); on stats iterations ~4
small reductions per hooked module; on full-dump iterations a device-to-host copy of every hooked
tensor (a deliberate sync). Hooks do not fire under CUDA-graph replay: run dump iterations eager.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stalwart.atomic_file import Sync, write_atomic

_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class DumpConfig:
    """Which dumps run and how often (``None`` = off). Intervals count the caller's iterations."""

    save_activations_interval: int | None = None
    save_dgrads_interval: int | None = None
    save_wgrads_interval: int | None = None
    save_params_interval: int | None = None
    save_tokens_per_expert_interval: int | None = None
    tensor_stats_interval: int | None = None
    module_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)

    def __post_init__(self) -> None:
        # Every interval has its flag but the statistics one, which follows --dump-stats-only
        # (or is set by a hand-written loop).
        for flag, value in self._intervals():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{flag} must be a positive integer or unset, got {value!r}")

    def _intervals(self) -> tuple[tuple[str, int | None], ...]:
        return (
            ("--save-activations-interval", self.save_activations_interval),
            ("--save-dgrads-interval", self.save_dgrads_interval),
            ("--save-wgrads-interval", self.save_wgrads_interval),
            ("--save-params-interval", self.save_params_interval),
            ("--save-tokens-per-expert-interval", self.save_tokens_per_expert_interval),
            ("DumpConfig.tensor_stats_interval", self.tensor_stats_interval),
        )

    @classmethod
    def from_flags(
        cls,
        *,
        save_activations_interval: int,
        log_dgrads: bool,
        log_tokens_per_expert: bool,
        dump_stats_only: bool,
        log_interval: int,
        save_wgrads_interval: int = 0,
        save_params_interval: int = 0,
        save_dgrads_interval: int = 0,
        save_tokens_per_expert_interval: int = 0,
    ) -> DumpConfig:
        """Map the trainer's flags. Megatron's interval flags (0: off) each have their own
        cadence and always write tensors: ``--save-dgrads-interval``, ``--save-wgrads-interval``,
        ``--save-params-interval``, ``--save-tokens-per-expert-interval``. stalwart's switches
        share one: ``--log-dgrads`` and ``--log-tokens-per-expert`` dump every
        ``--save-activations-interval`` iterations (``--log-interval`` when that is 0), and
        ``--dump-stats-only`` replaces the activation and ``--log-dgrads`` tensors with the
        per-module statistics. A Megatron interval wins over the switch of the same dump."""
        megatron = {
            "--save-wgrads-interval": save_wgrads_interval,
            "--save-params-interval": save_params_interval,
            "--save-dgrads-interval": save_dgrads_interval,
            "--save-tokens-per-expert-interval": save_tokens_per_expert_interval,
        }
        for flag, value in megatron.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{flag} must be an integer >= 0 (0: off), got {value!r}")
        interval = save_activations_interval if save_activations_interval > 0 else log_interval
        tensors = not dump_stats_only
        return cls(
            save_activations_interval=interval
            if tensors and save_activations_interval > 0
            else None,
            save_dgrads_interval=save_dgrads_interval
            or (interval if tensors and log_dgrads else None),
            save_wgrads_interval=save_wgrads_interval or None,
            save_params_interval=save_params_interval or None,
            save_tokens_per_expert_interval=save_tokens_per_expert_interval
            or (interval if log_tokens_per_expert else None),
            tensor_stats_interval=interval if dump_stats_only else None,
        )

    @property
    def any_enabled(self) -> bool:
        return any(v is not None for _, v in self._intervals())


def _due(interval: int | None, iteration: int) -> bool:
    return interval is not None and iteration % interval == 0


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    """Tensors inside a hook argument (tensor, tuple/list, dict), in order; ``None`` skipped."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _to_host(into: dict[str, torch.Tensor], prefix: str, value: Any) -> None:
    """The tensors of a hook argument into ``into`` as ``{prefix}{i}``, on the host. Deliberate
    sync: a device-to-host copy, made only on the iterations whose dump wants them."""
    for i, t in enumerate(_tensors(value)):
        into[f"{prefix}{i}"] = t.detach().to("cpu")


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    # copy=True: on CPU ``.to("cpu")`` would alias the live tensor, which clipping and the
    # optimizer change in place.
    return _local(t).detach().to("cpu", copy=True)


def layer_number(name: str) -> int | None:
    """First integer path component of a module name (``layers.3.mlp.router`` → 3)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


class TensorDumper:
    """Hook-based dumps for one model on one rank (see the module docstring).

    Args:
        model: the module to instrument (hooks go on its submodules).
        out_dir: run directory; files go into subdirectories of it.
        config: intervals.
        rank: global rank (file names).
        dp_rank: data-parallel rank; dgrads, wgrads and params are saved only on replica 0
            (with sharded parameters, FSDP2 DTensors, every rank saves its local shard).
    """

    def __init__(
        self,
        model: nn.Module,
        out_dir: str | os.PathLike[str],
        config: DumpConfig,
        rank: int = 0,
        dp_rank: int = 0,
    ) -> None:
        self.model = model
        self.out_dir = Path(out_dir)
        self.config = config
        self.rank = rank
        self.dp_rank = dp_rank
        routers = getattr(model, "moe_routers", None)
        self._routers: list[tuple[str, nn.Module]] = list(routers()) if callable(routers) else []
        router_ids = {id(m) for _, m in self._routers}
        self._modules: list[tuple[str, nn.Module]] = [
            (name, mod)
            for name, mod in model.named_modules()
            if isinstance(mod, config.module_types) or id(mod) in router_ids
        ]
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        sharded = any(callable(getattr(p, "to_local", None)) for _, p in self._params)
        self._saves_weights = dp_rank == 0 or sharded
        self._handles: list[RemovableHandle] = []
        self._iteration: int | None = None
        self._last_microbatch = True
        self._want_wgrads = self._want_tpe = False
        self._activations: dict[str, torch.Tensor] = {}
        self._dgrads: dict[str, torch.Tensor] = {}
        self._wgrads: dict[str, torch.Tensor] = {}
        # Per router: one device copy of its counts per micro-batch of the current pass.
        self._tpe: list[list[torch.Tensor]] = [[] for _ in self._routers]
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        # One row per module: mean, std, absmax, non-finite count. Written on device by hooks.
        self._stats = torch.zeros(len(self._modules), 4, dtype=torch.float32, device=device)
        self._stats_seen = [False] * len(self._modules)

    # -- per-iteration protocol ------------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        """Register the hooks that ``iteration`` needs (none on iterations that dump nothing)."""
        self._remove_hooks()
        self._iteration = iteration
        self._last_microbatch = True
        cfg = self.config
        want_acts = _due(cfg.save_activations_interval, iteration)
        want_stats = _due(cfg.tensor_stats_interval, iteration)
        want_dgrads = _due(cfg.save_dgrads_interval, iteration) and self.dp_rank == 0
        self._want_wgrads = _due(cfg.save_wgrads_interval, iteration) and self._saves_weights
        self._want_tpe = _due(cfg.save_tokens_per_expert_interval, iteration)
        self._wgrads, self._tpe = {}, [[] for _ in self._routers]
        if want_stats:
            self._stats.zero_()
            self._stats_seen = [False] * len(self._modules)
        for index, (name, mod) in enumerate(self._modules):
            if want_acts or want_stats:
                self._handles.append(
                    mod.register_forward_hook(
                        self._forward_hook(index, name, want_acts, want_stats)
                    )
                )
            if want_dgrads and isinstance(mod, nn.Embedding):
                # Integer inputs never need grad: a full backward hook would warn every backward,
                # so capture the output gradient with a tensor hook instead.
                self._handles.append(mod.register_forward_hook(self._output_grad_hook(name)))
            elif want_dgrads:
                self._handles.append(mod.register_full_backward_hook(self._backward_hook(name)))

    def begin_microbatch(self, index: int, is_last: bool) -> None:
        """Before micro-batch ``index``; index 0 starts a pass (a rerun pass replaces the first)."""
        self._last_microbatch = is_last
        if index == 0:
            self._wgrads, self._tpe = {}, [[] for _ in self._routers]

    def end_microbatch(self) -> None:
        """After a micro-batch's forward and backward: record tokens per expert (device copies,
        no sync); after the last one, copy the gradients (wgrads) before clipping changes them."""
        if self._want_tpe:
            for rows, (_, router) in zip(self._tpe, self._routers):
                tpe = getattr(router, "last_tokens_per_expert", None)
                if isinstance(tpe, torch.Tensor):
                    rows.append(tpe.detach().clone())
        if self._want_wgrads and self._last_microbatch:
            self._wgrads = {
                # Deliberate sync: device-to-host copy, only on wgrad-dump iterations.
                name: _host_copy(p.grad)
                for name, p in self._params
                if p.grad is not None
            }

    def end_iteration(self) -> None:
        """Write whatever this iteration collected, then remove the hooks."""
        it = self._iteration
        self._remove_hooks()
        if it is None:
            return
        self._iteration = None
        cfg = self.config
        if self._activations:
            self._save_tensors("activations", it, self._activations)
        if self._dgrads:
            self._save_tensors("dgrads", it, self._dgrads)
        if self._wgrads:
            self._save_tensors("wgrads", it, self._wgrads)
        if _due(cfg.save_params_interval, it) and self._saves_weights:
            # Deliberate sync: device-to-host copy, only on params-dump iterations.
            params = {name: _host_copy(p) for name, p in self._params}
            self._save_tensors("params", it, params)
        self._activations, self._dgrads, self._wgrads = {}, {}, {}
        if _due(cfg.tensor_stats_interval, it):
            self._write_stats(it)
        if self._want_tpe:
            self._write_tokens_per_expert(it)
        self._want_wgrads = self._want_tpe = False

    def close(self) -> None:
        """Remove every hook and drop collected tensors (safe to call twice)."""
        self._remove_hooks()
        self._activations, self._dgrads, self._wgrads = {}, {}, {}
        self._tpe = [[] for _ in self._routers]
        self._iteration = None

    # -- hooks -----------------------------------------------------------------------------------
    def _forward_hook(self, index: int, name: str, acts: bool, stats: bool) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self._last_microbatch:
                return
            if acts:
                _to_host(self._activations, f"{name}/input", inputs)
                _to_host(self._activations, f"{name}/output", output)
            if stats:
                self._record_stats(index, output)

        return hook

    def _backward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if not self._last_microbatch:
                return
            _to_host(self._dgrads, f"{name}/grad_input", grad_input)
            _to_host(self._dgrads, f"{name}/grad_output", grad_output)

        return hook

    def _output_grad_hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self._last_microbatch:
                return
            for i, t in enumerate(_tensors(output)):
                if t.requires_grad:
                    t.register_hook(self._store_grad(f"{name}/grad_output{i}"))

        return hook

    def _store_grad(self, key: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            # Deliberate sync: device-to-host copy, only on dgrad-dump iterations.
            self._dgrads[key] = grad.detach().to("cpu")

        return hook

    def _record_stats(self, index: int, output: Any) -> None:
        floats = [t.detach() for t in _tensors(output) if t.is_floating_point()]
        if not floats:
            return
        x = floats[0]
        n = max(x.numel(), 1)
        # fp32 accumulation without materialising an fp32 copy of a bf16 tensor.
        mean = x.sum(dtype=torch.float32) / n
        sq = torch.linalg.vector_norm(x, 2, dtype=torch.float32).square() / n
        std = (sq - mean.square()).clamp_min(0).sqrt()
        absmax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
        nonfinite = torch.isfinite(x).logical_not_().sum().to(torch.float32)
        self._stats[index].copy_(torch.stack([mean, std, absmax, nonfinite]))
        self._stats_seen[index] = True

    # -- writers ---------------------------------------------------------------------------------
    def _save_tensors(self, label: str, iteration: int, tensors: dict[str, torch.Tensor]) -> None:
        path = self.out_dir / label / f"iter_{iteration:07d}" / f"rank{self.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: torch.save(dict(tensors), tmp), sync=Sync.NONE)

    def _append_jsonl(self, label: str, lines: list[dict[str, Any]]) -> None:
        if not lines:
            return
        path = self.out_dir / label / f"rank{self.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)

    def _write_stats(self, iteration: int) -> None:
        # Deliberate sync: the one read of the statistics buffer per stats iteration.
        rows = self._stats.tolist()
        modules = {
            name: dict(zip(("mean", "std", "absmax", "nonfinite"), rows[i]))
            for i, (name, _) in enumerate(self._modules)
            if self._stats_seen[i]
        }
        self._append_jsonl("tensor_stats", [{"iteration": iteration, "modules": modules}])

    def _write_tokens_per_expert(self, iteration: int) -> None:
        """Megatron's records: ``{"iter", "block": "decoder", "layer", "tpe": [[...] per mb]}``."""
        records: list[dict[str, Any]] = []
        for rows, (name, router) in zip(self._tpe, self._routers):
            if not rows:  # no per-micro-batch calls (a loop without them): the last one's counts
                last = getattr(router, "last_tokens_per_expert", None)
                rows = [last.detach()] if isinstance(last, torch.Tensor) else []
            if not rows:
                continue
            # Deliberate sync: one read of every micro-batch's counts, at dump iterations only.
            tpe = torch.stack(rows).to("cpu").tolist()
            layer = layer_number(name)
            records.append(
                {
                    "iter": iteration,
                    "block": "decoder",
                    "layer": layer if layer is not None else -1,
                    "tpe": [[int(c) for c in mb] for mb in tpe],
                }
            )
        records.sort(key=lambda r: r["layer"])
        self._append_jsonl("tokens_per_expert", records)
        self._tpe = [[] for _ in self._routers]

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def num_hooks(self) -> int:
        return len(self._handles)


class NullTensorDumper:
    """All dumps off: no hooks, no buffers, no files."""

    num_hooks = 0

    def begin_iteration(self, iteration: int) -> None: ...
    def begin_microbatch(self, index: int, is_last: bool) -> None: ...
    def end_microbatch(self) -> None: ...
    def end_iteration(self) -> None: ...
    def close(self) -> None: ...


def make_tensor_dumper(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    config: DumpConfig,
    rank: int = 0,
    dp_rank: int = 0,
) -> TensorDumper | NullTensorDumper:
    """A `TensorDumper` when any interval is set, else the `NullTensorDumper`."""
    if not config.any_enabled:
        return NullTensorDumper()
    return TensorDumper(model, out_dir, config, rank, dp_rank)


@dataclass(kw_only=True, frozen=True)
class TensorDumpConfig:
    """The dump flags, one field each (0: off); :meth:`build` maps them onto a
    :class:`DumpConfig` (``DumpConfig.from_flags`` says how the switches share a cadence).
    ``dump_dir``: where the files go (default: the run directory)."""

    dump_dir: str | None = None
    save_activations_interval: int = 0
    log_dgrads: bool = False
    log_tokens_per_expert: bool = False
    dump_stats_only: bool = False
    save_dgrads_interval: int = 0
    save_wgrads_interval: int = 0
    save_tokens_per_expert_interval: int = 0
    save_params_interval: int = 0

    def __post_init__(self) -> None:
        value = self.save_activations_interval
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"--save-activations-interval must be an integer >= 0, got {value!r}")
        self.dump_config(log_interval=1)  # the other values checked, naming their flags

    def dump_config(self, *, log_interval: int) -> DumpConfig:
        return DumpConfig.from_flags(
            save_activations_interval=self.save_activations_interval,
            log_dgrads=self.log_dgrads,
            log_tokens_per_expert=self.log_tokens_per_expert,
            dump_stats_only=self.dump_stats_only,
            log_interval=log_interval,
            save_wgrads_interval=self.save_wgrads_interval,
            save_params_interval=self.save_params_interval,
            save_dgrads_interval=self.save_dgrads_interval,
            save_tokens_per_expert_interval=self.save_tokens_per_expert_interval,
        )

    def build(
        self, model: nn.Module, *, run_dir: str | None, log_interval: int, rank: int
    ) -> TensorDumper | NullTensorDumper:
        """The dumper of ``model`` (the unwrapped module: its parameter names are the files')."""
        config = self.dump_config(log_interval=log_interval)
        return make_tensor_dumper(model, self.dump_dir or run_dir or ".", config, rank, rank)
