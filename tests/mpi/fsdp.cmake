# FSDP2 semantics on 4 ranks: HSDP vs FSDP, bf16 mixed precision, ZeRO
# stages, prefetch and reshard policies (tests/mpi/test_fsdp.c).
add_executable(test_fsdp test_fsdp.c parity_util.c)
target_link_libraries(test_fsdp PRIVATE meshlm_core PkgConfig::CMOCKA)
target_compile_definitions(test_fsdp PRIVATE ML_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
foreach(fx llama_untied qwen3 gemma3)
  ml_mpi_test(fsdp_${fx} 4 $<TARGET_FILE:test_fsdp> ${fx})
endforeach()
