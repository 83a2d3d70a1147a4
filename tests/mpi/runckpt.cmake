# Run checkpoints (ckpt/runckpt.h): resume bitwise on the same mesh, reshard
# on load (other dp/tp, one rank), HSDP <-> FSDP, one-process HF export,
# the commit protocol and the errors. Saved on dp_shard = N / TP x tp = TP.
ml_mpi_executable(test_runckpt test_runckpt.c parity_util.c)
ml_mpi_test_2blas(runckpt_llama_untied_dp2_tp2 4 $<TARGET_FILE:test_runckpt> llama_untied 2)
ml_mpi_test_2blas(runckpt_qwen3_dp4 4 $<TARGET_FILE:test_runckpt> qwen3 1)
ml_mpi_test_2blas(runckpt_llama_tied_tp2 2 $<TARGET_FILE:test_runckpt> llama_tied 2)
ml_mpi_test_2blas(runckpt_gemma3_vlm_dp2 2 $<TARGET_FILE:test_runckpt> gemma3_vlm 1)
# heads over tp beyond what tp divides: copies of shared kv heads written once, read by all
ml_mpi_test(runckpt_llama_h9kv3_tp4 4 $<TARGET_FILE:test_runckpt> llama_h9kv3 4)
ml_mpi_test(runckpt_gemma3_h4kv1_tp2 2 $<TARGET_FILE:test_runckpt> gemma3_h4kv1 2)
# expert parallelism (parallel/ep.h): each ep rank writes the experts it holds; resumed bitwise
# on ep 2, read back on one rank (and HSDP 2 x ep 2) bitwise, the collective HF export = the
# one-process export of the checkpoint
ml_mpi_test(runckpt_qwen3_moe_ep2 2 $<TARGET_FILE:test_runckpt> qwen3_moe 1 ep=2)
# the ep group spanning tp 2: the tp ranks hold different experts, each writing its own
# (engine.h ml_engine_owned_rows)
ml_mpi_test(runckpt_qwen3_moe_tp2_ep2 2 $<TARGET_FILE:test_runckpt> qwen3_moe 2 ep=2)
