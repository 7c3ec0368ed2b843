"""The long tail of Megatron-LM flags that stalwart does not implement, one reason per group.

Read from Megatron-LM's ``megatron/training/arguments.py`` (the ``_add_<group>_args`` groups):
every flag there that ``stalwart train`` neither implements nor refuses in
``megatron_flags.UNSUPPORTED`` is listed here, so a migrating script that passes one gets its
refusal by name (``--X is a Megatron flag stalwart does not implement (reason)``), not "neither
a stalwart flag nor a Megatron flag stalwart knows". Each group is ``(reason, flags that take a
value, switches)``; `TAIL_ACCEPTED` holds the values that mean what stalwart does anyway.
Data only: ``megatron_flags`` turns it into refusals. Megatron's underscore aliases
``--override-opt_param-scheduler`` and ``--use-checkpoint-opt_param-scheduler`` are left out:
``--config`` keys spell ``override_opt_param_scheduler`` with underscores, and that key is
stalwart's own ``--override-opt-param-scheduler``.
"""

from __future__ import annotations

_DP = "stalwart trains data-parallel: DDP, or --use-torch-fsdp2"
_GPT = "the model is a decoder-only GPT"
_CKPT = "checkpoints are torch.distributed.checkpoint directories of their own layout"
_FP8 = "FP8 training; use --bf16"
_MLP = "the MLP is GELU, or SwiGLU with --swiglu"
_MOE = "experts are replicated dense MLPs with one top-k softmax router"
_RECOMPUTE = "no per-module recompute choice: --recompute-granularity full or selective"
_OFFLOAD = "the optimizer states stay on the device"
_NCCL = "process groups use NCCL's defaults"
_TE = "Transformer Engine layers; the model is plain PyTorch"

TAIL: tuple[tuple[str, str, str], ...] = (
    # network size
    (
        f"encoder-decoder and BERT models are not implemented; {_GPT}: --num-layers",
        "--encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length",
        "--bert-no-binary-head",
    ),
    (
        "attention variants (sliding window, softmax offset) are not implemented: attention is "
        "full causal softmax",
        "--softmax-type --window-size --window-attn-skip-freq",
        "",
    ),
    (
        "relative position embeddings are not implemented: --position-embedding-type rope or "
        "learned_absolute",
        "--relative-attention-num-buckets --relative-attention-max-distance",
        "",
    ),
    (
        "RoPE variants (interleaved, YaRN, skipped layers, multimodal) are not implemented: RoPE "
        "takes --rotary-base and Llama 3.x scaling (--use-rope-scaling --rope-scaling-factor)",
        "--no-rope-freq --mrope-section --rope-type",
        "--rotary-interleaved",
    ),
    (
        _MLP,
        "--activation-func-clamp-value --glu-linear-offset",
        "--quick-geglu --use-fused-weighted-squared-relu",
    ),
    ("no ONNX export", "--onnx-safe", ""),
    ("multi-token prediction is not implemented", "--mtp-loss-scaling-factor", ""),
    # regularization
    (
        "the Muon optimizer is not implemented; the optimizer is AdamW",
        "--muon-momentum --muon-scale-mode --muon-fp32-matmul-prec --muon-num-ns-steps "
        "--muon-tp-mode "
        "--muon-extra-scale-factor",
        "--muon-no-split-qkv --muon-use-nesterov",
    ),
    # rl
    (
        "reinforcement learning (GRPO rollouts) is not implemented: stalwart pretrains",
        "--rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --grpo-iterations "
        "--grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight "
        "--grpo-default-temperature --grpo-default-top-p --langrl-inference-server-type "
        "--langrl-inference-server-conversation-template --langrl-env-config "
        "--rl-importance-sampling-truncation-coef --rl-sequence-packing-bin-size "
        "--rl-sequence-packing-algo",
        "--perform-rl-step --grpo-filter-groups-with-same-reward --langrl-external-server "
        "--no-langrl-external-server --rl-offload-optimizer-during-inference "
        "--rl-offload-kv-cache-during-training --no-rl-offload-kv-cache-during-training "
        "--rl-remove-kv-cache-during-training --no-rl-remove-kv-cache-during-training "
        "--rl-reset-cuda-graphs --no-rl-reset-cuda-graphs --rl-partial-rollouts "
        "--no-rl-partial-rollouts "
        "--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction "
        "--rl-calculate-intra-group-similarity --no-rl-calculate-intra-group-similarity "
        "--rl-use-sequence-packing",
    ),
    # training
    ("Megatron's old spelling: use --micro-batch-size", "--batch-size", ""),
    ("Megatron's old spelling: use --recompute-granularity full", "", "--checkpoint-activations"),
    ("the global batch size is fixed: --global-batch-size", "", "--decrease-batch-size-if-needed"),
    (_RECOMPUTE, "--recompute-modules", "--moe-layer-recompute"),
    (
        "no activation offloading: --recompute-granularity saves memory",
        "--cpu-offloading-num-layers",
        "",
    ),
    (
        f"tensor parallelism; {_DP}",
        "--tp-comm-overlap-cfg --tp-comm-bootstrap-backend",
        "--distribute-saved-activations --no-clone-scatter-output-in-embedding "
        "--disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad "
        "--disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad --disable-tp-comm-split-ag "
        "--disable-tp-comm-split-rs",
    ),
    ("stalwart's process groups are not configurable", "", "--disable-gloo-process-groups"),
    ("no periodic CPU-GPU synchronisation knob", "--train-sync-interval", ""),
    (
        "a fused kernel of Transformer Engine / Apex; the model is plain PyTorch",
        "--cross-entropy-fusion-impl",
        "--moe-router-fusion",
    ),
    (
        "no QKV-only bias: the linear layers' bias follows --disable-bias-linear",
        "",
        "--add-qkv-bias",
    ),
    (
        _OFFLOAD,
        "--optimizer-offload-fraction",
        "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads "
        "--no-pin-cpu-params",
    ),
    ("parameter groups are not configurable", "--dump-param-to-param-group-map", ""),
    (
        _NCCL,
        "--high-priority-stream-groups --sharp-enabled-group",
        "--use-nccl-ub --disable-symmetric-registration --use-sharp",
    ),
    (_TE, "", "--use-te-activation-func --delay-wgrad-compute"),
    # initialization
    (
        "every data-parallel rank starts from the same weights (--seed)",
        "",
        "--data-parallel-random-init",
    ),
    ("weights are normal with --init-method-std", "--embedding-init-method-std", ""),
    # learning rate
    ("no WSD schedule: --lr-decay-style", "--lr-wsd-decay-samples", ""),
    ("Megatron's old spelling: use --lr-warmup-iters", "--warmup", ""),
    # checkpointing
    ("stalwart spells it --save-interval", "--persistent-save-interval", ""),
    (
        _CKPT,
        "--dist-ckpt-format --ckpt-convert-format --ckpt-convert-save",
        "--load-main-params-from-ckpt --no-strict-fsdp-dtensor-load "
        "--ckpt-convert-update-legacy-dist-opt-format --dist-ckpt-save-pre-mcore-014 "
        "--dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient",
    ),
    ("--load reads the directory's latest checkpoint", "--ckpt-step", ""),
    (
        f"model parallelism; {_DP}",
        "--model-parallel-size",
        "--use-mp-args-from-checkpoint-args --use-tp-pp-dp-mapping",
    ),
    # mixed precision
    (
        "no separate precision for residual connections: --bf16 or --fp16 sets it",
        "",
        "--fp32-residual-connection",
    ),
    ("matmul precision is torch's default", "", "--disable-bf16-reduced-precision-matmul"),
    (
        _FP8,
        "--fp8-quantizer-factory --fp8-margin --fp8-interval --fp8-amax-history-len "
        "--fp8-amax-compute-algo --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16",
        "--no-fp8-wgrad --first-last-layers-bf16 --reuse-grad-buf-for-mxfp8-param-ag "
        "--moe-router-padding-for-fp8 --keep-fp8-transpose-cache",
    ),
    ("FP4 training; use --bf16", "--fp4-recipe --fp4-quantizer-factory", "--fp4-param-gather"),
    # distributed
    (
        f"pipeline parallelism; {_DP}",
        "--pipeline-model-parallel-layout --num-virtual-stages-per-pipeline-rank "
        "--microbatch-group-size-per-virtual-pipeline-stage --wgrad-deferral-limit "
        "--pipeline-model-parallel-comm-backend",
        "--no-overlap-p2p-communication --overlap-p2p-communication-warmup-flush "
        "--defer-embedding-wgrad-compute --no-align-grad-reduce --no-align-param-gather "
        "--no-scatter-gather-tensors-in-pipeline --use-ring-exchange-p2p",
    ),
    (f"context parallelism; {_DP}", "--cp-comm-type --hierarchical-context-parallel-sizes", ""),
    (
        "one process-group timeout: --distributed-timeout-minutes",
        "--distributed-timeout-seconds-after-init",
        "",
    ),
    ("DDP uses torch's buckets", "--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw"),
    ("gradients are reduced in fp32", "", "--ddp-reduce-scatter-with-fp32-accumulation"),
    ("the local rank comes from torchrun's LOCAL_RANK", "--local-rank", ""),
    ("stalwart initialises its process groups itself", "--lazy-mpu-init", ""),
    (
        "the model is initialised on the CPU, then moved to the device",
        "",
        "--init-model-with-meta-device",
    ),
    (
        "Megatron FSDP options: use --use-torch-fsdp2",
        "--suggested-communication-unit-size",
        "--no-gradient-reduce-div-fusion --fsdp-double-buffer --enable-full-sharding-in-hsdp",
    ),
    ("no FSDP2 resharding option", "", "--torch-fsdp2-no-reshard-after-forward"),
    # validation
    ("validation runs --eval-iters batches", "", "--full-validation"),
    ("one validation set: --valid-fraction of --data-path", "", "--multiple-validation-sets"),
    ("no real-time test mode", "", "--test-mode"),
    ("no evaluation-only run: stalwart trains", "", "--skip-train"),
    # tokenizer
    (
        "the vocabulary is --vocab-size, not padded (a multiple of --make-vocab-size-divisible-by)",
        "--padded-vocab-size",
        "",
    ),
    (
        "no tokenizer; --data-path takes token ids (.bin) or raw bytes (.txt)",
        "--vocab-extra-ids --tokenizer-metadata --tiktoken-pattern --tiktoken-num-special-tokens "
        "--tiktoken-special-tokens",
        "--legacy-tokenizer --trust-remote-code --no-use-tokenizer-model-from-checkpoint-args",
    ),
    # data
    (f"masked-LM (BERT, T5) data is not implemented; {_GPT}", "--mask-prob --short-seq-prob", ""),
    ("no subsampling of the training data", "--sample-rate", ""),
    (
        "no object-storage datasets: --data-path takes local files",
        "--object-storage-cache-path",
        "",
    ),
    ("no Multi-Storage Client: paths are local files", "", "--disable-msc"),
    ("datasets are memory-mapped, nothing is built", "--mid-level-dataset-surplus", ""),
    ("no pad tokens: every token's loss counts", "", "--allow-ambiguous-pad-tokens"),
    # biencoder
    (
        f"biencoder / ICT retrieval models are not implemented; {_GPT}",
        "--retriever-seq-length --ict-head-size --biencoder-projection-dim --ict-load --bert-load "
        "--titles-data-path --query-in-block-prob --evidence-data-path "
        "--retriever-report-topk-accuracies --block-data-path --embedding-path "
        "--indexer-batch-size "
        "--indexer-log-interval",
        "--biencoder-shared-query-context-model --use-one-sent-docs --retriever-score-scaling",
    ),
    # vision
    (
        f"vision models (ViT, Swin, DINO, inpainting) are not implemented; {_GPT}",
        "--num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction "
        "--data-per-class-fraction --head-lr-mult --vision-pretraining-type --vision-backbone-type "
        "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
        "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size "
        "--dino-freeze-last-layer --dino-warmup-teacher-temp --dino-teacher-temp "
        "--dino-warmup-teacher-temp-epochs",
        "--no-data-sharding --vision-pretraining --dino-norm-last-layer",
    ),
    ("no norm on queries and keys", "", "--qk-l2-norm"),
    # moe
    (f"{_MOE}; no shared experts", "", "--moe-shared-expert-overlap"),
    ("experts run as separate MLPs", "", "--moe-use-legacy-grouped-gemm"),
    (
        "experts are replicated on every rank",
        "",
        "--moe-extended-tp --overlap-moe-expert-parallel-comm",
    ),
    ("no dense-to-MoE upcycling", "--moe-upcycling-granularity", "--moe-use-upcycling"),
    (
        _MOE,
        "--moe-router-num-groups --moe-router-group-topk --moe-router-topk-scaling-factor "
        "--moe-token-drop-policy",
        "--moe-router-force-load-balancing --moe-per-layer-logging "
        "--moe-pad-expert-input-to-capacity "
        "--moe-apply-probs-on-input",
    ),
    ("experts are replicated: no token dispatch", "--moe-deepep-num-sms", "--moe-enable-deepep"),
    # mla
    (
        "multi-latent attention is not implemented",
        "--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim "
        "--rotary-scaling-factor --mscale --mscale-all-dim",
        "--cache-mla-latents",
    ),
    # heterogeneous
    (
        "heterogeneous layer configurations are not implemented: every layer has the same shape",
        "--heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json",
        "",
    ),
    # logging
    ("no timer barrier switch", "", "--no-barrier-with-level-1-timing"),
    ("no workload-inspector server: use --profile", "", "--run-workload-inspector-server"),
    (
        "no OneLogger: --tensorboard-dir, --wandb-project",
        "--one-logger-project --one-logger-run-name --app-tag-run-name --app-tag-run-version",
        "--no-one-logger --one-logger-async",
    ),
    ("--print-config writes the run's settings", "--config-logger-dir", ""),
    # inference
    (
        "inference server options: stalwart trains only",
        "--inference-batch-times-seqlen-threshold --max-tokens-to-oom --bert-embedder-type "
        "--inference-max-requests --inference-max-seq-length --inference-max-batch-size "
        "--inference-dynamic-batching-buffer-size-gb --inference-dynamic-batching-block-size "
        "--inference-dynamic-batching-buffer-guaranteed-fraction "
        "--inference-dynamic-batching-buffer-overflow-factor "
        "--inference-dynamic-batching-max-requests-override "
        "--inference-dynamic-batching-max-tokens-override "
        "--inference-dynamic-batching-num-cuda-graphs "
        "--inference-dynamic-batching-unified-memory-level --symmetric-ar-type "
        "--mlp-chunks-for-prefill "
        "--inference-wandb-logging-step-interval",
        "--output-bert-embeddings --flash-decode --use-legacy-static-engine "
        "--inference-dynamic-batching "
        "--inference-dynamic-batching-track-paused-request-events --decode-only-cuda-graphs "
        "--nccl-all-reduce-for-prefill --disable-chunked-prefill --inference-rng-tracker "
        "--moe-pad-experts-for-cuda-graph-inference",
    ),
    # retro
    (
        "Retro retrieval is not implemented",
        "--retro-project-dir --retro-cyclic-train-iters --retro-encoder-layers "
        "--retro-encoder-hidden-dropout --retro-encoder-attention-dropout --retro-num-neighbors "
        "--retro-num-retrieved-chunks --retro-attention-gate",
        "--retro-add-retriever --retro-no-verify-neighbor-count",
    ),
    # experimental
    (
        "hybrid Mamba models are not implemented; the model is a transformer",
        "--hybrid-attention-ratio --hybrid-mlp-ratio --hybrid-override-pattern --mamba-state-dim "
        "--mamba-head-dim --mamba-num-groups --mamba-num-heads",
        "--is-hybrid-model --disable-mamba-mem-eff-path",
    ),
    ("no experimental-features switch", "", "--enable-experimental"),
    ("use --config FILE (TOML, as --print-config writes it)", "--yaml-cfg", ""),
    # kitchen, sft
    (
        "Kitchen quantization is not implemented",
        "--kitchen-config-file --kitchen-recipe-number",
        "",
    ),
    (
        "supervised fine-tuning datasets and prompt formats are not implemented",
        "--sft-tokenizer-prompt-format",
        "--sft",
    ),
)

# Values of tail flags that mean what stalwart does anyway: accepted, change nothing.
TAIL_ACCEPTED: dict[str, tuple[str, ...]] = {
    "--softmax-type": ("vanilla",),
    "--rope-type": ("rope",),
    "--model-parallel-size": ("1",),
    "--cross-entropy-fusion-impl": ("native",),
}
