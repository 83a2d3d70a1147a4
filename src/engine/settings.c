#include "engine/settings.h"

ml_train_settings ml_train_defaults(ml_defaults_for who) {
  bool api = who == ML_DEFAULTS_API;
  ml_train_settings s = (ml_train_settings){
      .engine = ml_engine_opts_default(),
      .step = {.schedule = {.decay = ML_LR_CONSTANT, .lr = api ? 1e-5 : 3e-4, .min_lr = 0,
                            .warmup_steps = 0, .total_steps = api ? 1 : 10},
               .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = api ? 0.01 : 0,
               .max_grad_norm = 1.0, .norm_type = 2.0}};
  /* batch-invariant log-probs: off, its fixed-order GEMM and attention cost a large part
   * of the speed (bench/batch_invariant.sh) */
  s.engine.batch_invariant = false;
  /* frozen parameters: none (every parameter trains, as torch's requires_grad default) */
  s.engine.freeze = NULL;
  /* parameters kept in fp32 under bf16: the MoE routers alone (engine/fp32_params.h) */
  s.engine.fp32_params = NULL;
  /* LoRA: off (rank 0); when on, PEFT LoraConfig's defaults (lora_alpha 8, lora_dropout 0,
   * use_rslora false) and every linear of the decoder (all-linear); no adapter to start from */
  s.engine.lora = (ml_lora_opts){.rank = 0, .alpha = 8.0, .dropout = 0.0,
                                 .targets = "all-linear", .rslora = false, .adapter = NULL};
  return s;
}
