# libFuzzer targets (-DCLEAVE_FUZZ=ON, clang only; scripts/fuzz.sh drives
# them). Each target links only the library sources it exercises, compiled
# for libFuzzer's coverage with ASan + UBSan (UB aborts), so the clang build
# stays small.
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "CLEAVE_FUZZ needs clang (CXX=clang++), not ${CMAKE_CXX_COMPILER_ID}")
endif()
set(CLEAVE_FUZZ_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer)

# cleave_fuzz_objects(NAME SOURCES...): library sources instrumented for
# fuzzing, as an OBJECT library that fuzz targets link.
function(cleave_fuzz_objects name)
  add_library(${name} OBJECT ${ARGN})
  # g++ -Werror is the gate for these sources; clang's extra warnings must not
  # stop a fuzz run.
  target_compile_options(${name} PRIVATE -Wno-error)
  target_compile_options(${name} PUBLIC ${CLEAVE_FUZZ_FLAGS} -fsanitize=fuzzer-no-link)
  target_link_options(${name} PUBLIC ${CLEAVE_FUZZ_FLAGS})
  target_link_libraries(${name} PUBLIC cleave_common)
endfunction()

# cleave_fuzz_target(NAME SOURCE OBJECTS...): a libFuzzer executable.
function(cleave_fuzz_target name source)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE ${ARGN})
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
endfunction()

# storage/block.cpp (KvLayout::validate, BlockKey::hex, checksum_bytes) and
# what it calls (the checksums, check_kv_type): the codec and the placement
# policies use them.
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY xxhash REQUIRED)
set(CLEAVE_FUZZ_BLOCK_SRC ${PROJECT_SOURCE_DIR}/storage/block.cpp
    ${PROJECT_SOURCE_DIR}/storage/checksum_avx2.cpp ${PROJECT_SOURCE_DIR}/kernels/kv_types.cpp)
set_source_files_properties(${PROJECT_SOURCE_DIR}/storage/checksum_avx2.cpp
                            PROPERTIES COMPILE_OPTIONS "-mavx2")
cleave_fuzz_objects(cleave_block_fuzzobj ${CLEAVE_FUZZ_BLOCK_SRC})
target_include_directories(cleave_block_fuzzobj SYSTEM PRIVATE ${XXHASH_INCLUDE_DIR})
target_link_libraries(cleave_block_fuzzobj PUBLIC ${XXHASH_LIBRARY})
