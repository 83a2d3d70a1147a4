# Real bf16 compute on every family, 4 ranks: against fp32 on one rank, and
# one rank against dp2 x tp2 in bf16 (tests/mpi/test_bf16.c); again under the
# second kernel set, where the bf16 GEMMs are emulated.
ml_mpi_executable(test_bf16 test_bf16.c parity_util.c train_check.c)
foreach(fx llama_tied llama_untied qwen2 qwen3 gemma3 gemma3_vlm mistral phi3)
  ml_mpi_test_2blas(bf16_${fx} 4 $<TARGET_FILE:test_bf16> ${fx})
endforeach()

# The fused classifier (parallel/loss.h) in tiles against the unfused one:
# fp32 on 1 rank and dp2 x tp2, bf16 mesh parity (tests/mpi/test_classifier.c).
ml_mpi_executable(test_classifier test_classifier.c parity_util.c train_check.c)
foreach(fx llama_tied llama_untied qwen3 gemma3)
  ml_mpi_test_2blas(classifier_${fx} 4 $<TARGET_FILE:test_classifier> ${fx})
endforeach()
