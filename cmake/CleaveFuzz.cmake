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
