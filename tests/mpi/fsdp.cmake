# FSDP2 semantics on 4 ranks: HSDP vs FSDP, bf16 mixed precision, ZeRO
# stages, prefetch and reshard policies (tests/mpi/test_fsdp.c).
ml_mpi_executable(test_fsdp test_fsdp.c parity_util.c train_check.c)
foreach(fx llama_untied qwen3 gemma3)
  ml_mpi_test_2blas(fsdp_${fx} 4 $<TARGET_FILE:test_fsdp> ${fx})
endforeach()
# mixture-of-experts fixtures: experts are parameters like any other to FSDP (no tp: refused)
foreach(fx qwen3_moe mixtral)
  ml_mpi_test(fsdp_${fx} 4 $<TARGET_FILE:test_fsdp> ${fx} 1)
endforeach()

# The steady-state step takes no block from the system (pool statistics),
# fp32 and bf16, on one rank and on dp_shard 2 x tp 2 (tests/mpi/test_steady.c).
ml_mpi_executable(test_steady test_steady.c parity_util.c train_check.c)
ml_mpi_test(steady_llama_tied_1rank 1 $<TARGET_FILE:test_steady> llama_tied 1)
ml_mpi_test(steady_llama_tied_dp2_tp2 4 $<TARGET_FILE:test_steady> llama_tied 2)

# Forward-only passes (scoring) keep one layer's activations, with the same
# log-probs bitwise (pool statistics; tests/mpi/test_forward_only.c).
ml_mpi_executable(test_forward_only test_forward_only.c parity_util.c)
ml_mpi_test(forward_only_llama_tied_1rank 1 $<TARGET_FILE:test_forward_only> llama_tied 1)
ml_mpi_test(forward_only_gemma3_1rank 1 $<TARGET_FILE:test_forward_only> gemma3 1)
ml_mpi_test(forward_only_qwen3_moe_1rank 1 $<TARGET_FILE:test_forward_only> qwen3_moe 1)
ml_mpi_test(forward_only_llama_tied_dp2_tp2 4 $<TARGET_FILE:test_forward_only> llama_tied 2)
# an untied lm_head's vocab-parallel rows from the inference-only bf16 shard (dp2)
ml_mpi_test(forward_only_llama_untied_dp2 2 $<TARGET_FILE:test_forward_only> llama_untied 1)
