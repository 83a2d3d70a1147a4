# Activation checkpointing (ml_ac_mode): every mode against ac none, bitwise
# loss and gradients, the recompute's tp collectives, saved bytes per mode.
add_executable(test_ac test_ac.c parity_util.c)
target_link_libraries(test_ac PRIVATE meshlm_core PkgConfig::CMOCKA)
target_compile_definitions(test_ac PRIVATE ML_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
foreach(fx llama_tied qwen3 gemma3)
  ml_mpi_test(ac_${fx}_1rank 1 $<TARGET_FILE:test_ac> ${fx} 1)
endforeach()
foreach(fx qwen3 gemma3)
  ml_mpi_test(ac_${fx}_dp2_tp2_sp 4 $<TARGET_FILE:test_ac> ${fx} 2 sp)
endforeach()
