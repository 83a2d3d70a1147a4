# FSDP2 semantics on 4 ranks: HSDP vs FSDP, bf16 mixed precision, ZeRO
# stages, prefetch and reshard policies (tests/mpi/test_fsdp.c).
ml_mpi_executable(test_fsdp test_fsdp.c parity_util.c train_check.c)
foreach(fx llama_untied qwen3 gemma3)
  ml_mpi_test_2blas(fsdp_${fx} 4 $<TARGET_FILE:test_fsdp> ${fx})
endforeach()
