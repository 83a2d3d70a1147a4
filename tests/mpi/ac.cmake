# Activation checkpointing (ml_ac_mode): every mode against ac none, bitwise
# loss and gradients, the recompute's tp collectives, saved bytes per mode.
ml_mpi_executable(test_ac test_ac.c parity_util.c)
foreach(fx llama_tied qwen3 gemma3)
  ml_mpi_test_2blas(ac_${fx}_1rank 1 $<TARGET_FILE:test_ac> ${fx} 1)
endforeach()
# bf16 parameters: the unit boundaries' casts fused across layers survive each recompute
ml_mpi_test(ac_llama_tied_1rank_bf16 1 $<TARGET_FILE:test_ac> llama_tied 1 bf16)
# a sparse MoE block recomputed (its routing again, the aux sums not twice: model/moe.h)
ml_mpi_test(ac_qwen3_moe_1rank 1 $<TARGET_FILE:test_ac> qwen3_moe 1)
# ... with a shared expert, whose saved buffers are the MLP part's too (model/moe_shared.h)
ml_mpi_test(ac_qwen2_moe_1rank 1 $<TARGET_FILE:test_ac> qwen2_moe 1)
foreach(fx qwen3 gemma3)
  ml_mpi_test_2blas(ac_${fx}_dp2_tp2_sp 4 $<TARGET_FILE:test_ac> ${fx} 2 sp)
endforeach()
# context parallelism: the recompute reruns ring attention (cp send_recv)
foreach(fx llama_tied gemma3)
  ml_mpi_test(ac_${fx}_cp2_tp2 4 $<TARGET_FILE:test_ac> ${fx} 2 cp=2)
endforeach()
