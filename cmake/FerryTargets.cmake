# Helpers that give every ferry target the same flags.

set_property(GLOBAL PROPERTY FERRY_COMPONENT_TARGETS "")

# Flags for ferry's own code: warnings, sanitizers. Torch headers come in as -isystem, so their
# warnings stay out of the way.
function(ferry_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Werror=switch -Werror=return-type>)
  # One sanitizer set per build (CMakeLists.txt refuses both): ASan + UBSan, or TSan.
  set(sanitize "")
  if(FERRY_SANITIZE)
    set(sanitize address,undefined)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize-recover=undefined>)
  elseif(FERRY_TSAN)
    set(sanitize thread)
  endif()
  if(sanitize)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${sanitize} -fno-omit-frame-pointer>)
    get_target_property(type ${target} TYPE)
    if(NOT type STREQUAL "OBJECT_LIBRARY")
      target_link_options(${target} PRIVATE -fsanitize=${sanitize})
    endif()
  endif()
  # Line counts (scripts/coverage.sh): -O1 after the build type's flags keeps them close to the source
  # without -O0's cost in the CPU Adam kernels; -fprofile-update=atomic because the counters are
  # updated from OpenMP, oneTBB and ferry's own threads.
  if(FERRY_COVERAGE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:--coverage -O1 -fprofile-update=atomic>)
    get_target_property(type ${target} TYPE)
    if(NOT type STREQUAL "OBJECT_LIBRARY")
      target_link_options(${target} PRIVATE --coverage)
    endif()
  endif()
endfunction()

# ferry_add_component(NAME SOURCES src... [LINK deps...] [NO_TORCH])
# One OBJECT library per source folder; its objects go into libferry.so. LINK names the components
# below it (the layers, docs/ARCHITECTURE.md) and external libraries. Includes between ferry's files are
# relative ("../chunk/chunk_store.h"), so a component needs no include directory of ferry's: which
# folders it may include is what it links, checked by ctest `layers` (scripts/check_layers.py) against
# the graph ferry_write_layer_graph() writes.
function(ferry_add_component name)
  cmake_parse_arguments(ARG "NO_TORCH" "" "SOURCES;LINK" ${ARGN})
  add_library(${name} OBJECT ${ARG_SOURCES})
  if(NOT ARG_NO_TORCH)
    target_link_libraries(${name} PUBLIC torch)
  endif()
  if(ARG_LINK)
    target_link_libraries(${name} PUBLIC ${ARG_LINK})
  endif()
  if(FERRY_WITH_CUDA)
    target_compile_definitions(${name} PUBLIC FERRY_WITH_CUDA=1)
  endif()
  ferry_target_defaults(${name})
  file(RELATIVE_PATH folder "${PROJECT_SOURCE_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}")
  set_property(GLOBAL APPEND PROPERTY FERRY_COMPONENT_TARGETS ${name})
  set_property(GLOBAL PROPERTY FERRY_COMPONENT_FOLDER_${name} "${folder}")
  set_property(GLOBAL PROPERTY FERRY_COMPONENT_LINK_${name} "${ARG_LINK}")
endfunction()

# Writes the folders' layer graph (`folder: the folders of the components it links`, one line each) to
# FILE: what ctest `layers` checks the includes and docs/ARCHITECTURE.md's layer block against.
function(ferry_write_layer_graph file)
  get_property(components GLOBAL PROPERTY FERRY_COMPONENT_TARGETS)
  set(folders "")
  foreach(component IN LISTS components)
    get_property(folder GLOBAL PROPERTY FERRY_COMPONENT_FOLDER_${component})
    list(APPEND folders ${folder})
    foreach(dep IN LISTS components)
      get_property(links GLOBAL PROPERTY FERRY_COMPONENT_LINK_${component})
      if(dep IN_LIST links)
        get_property(dep_folder GLOBAL PROPERTY FERRY_COMPONENT_FOLDER_${dep})
        if(NOT dep_folder STREQUAL folder)
          set_property(GLOBAL APPEND PROPERTY FERRY_LAYER_DEPS_${folder} ${dep_folder})
        endif()
      endif()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES folders)
  set(text "# folder: the folders of the components it links (written by CMake; checked by ctest layers)\n")
  foreach(folder IN LISTS folders)
    get_property(deps GLOBAL PROPERTY FERRY_LAYER_DEPS_${folder})
    if(deps)
      list(REMOVE_DUPLICATES deps)
      list(SORT deps)
    endif()
    string(REPLACE ";" " " deps "${deps}")
    string(APPEND text "${folder}: ${deps}\n")
  endforeach()
  file(WRITE "${file}" "${text}")
endfunction()

# ferry_test_environment(test): the sanitizers' settings for a test of a sanitizer build (ferry_add_test
# calls it; a test added with add_test calls it itself). Sets the test's ENVIRONMENT.
function(ferry_test_environment name)
  if(FERRY_SANITIZE)
    # torch's own allocations are not ours to judge; CUDA needs the shadow gap left alone.
    set_tests_properties(${name} PROPERTIES ENVIRONMENT
      "ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0;UBSAN_OPTIONS=print_stacktrace=1")
  endif()
  if(FERRY_TSAN)
    # Ferry's own code is what this build checks; the libraries under it (torch, c10d and Gloo, oneTBB,
    # libgomp, libstdc++) are not instrumented, so their synchronization is invisible to the sanitizer:
    #  - one OpenMP thread (OMP_THREAD_LIMIT also caps CpuAdam's num_threads clauses): libgomp's barriers
    #    are unseen, so every parallel region would be reported;
    #  - ignore_noninstrumented_modules: frees and copies called from those libraries are not checked
    #    (a tensor or a Gloo work released on Gloo's thread after a reference count the sanitizer did
    #    not see fall), ferry's own accesses all are;
    #  - scripts/tsan.supp: what remains of such hand-offs in library code inlined into ferry's.
    set_tests_properties(${name} PROPERTIES ENVIRONMENT
      "OMP_NUM_THREADS=1;OMP_THREAD_LIMIT=1;TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=${PROJECT_SOURCE_DIR}/scripts/tsan.supp")
  endif()
endfunction()

# ferry_use_test_pch(target sources...): the target compiles against ferry_test_pch's precompiled
# <torch/torch.h> (FERRY_TEST_PCH; D102) where its sources, or the test headers they include
# ("fixtures.h", one level deep), include <torch/torch.h>; other tests are left to their own includes,
# so those stay honest.
function(ferry_use_test_pch target)
  if(NOT FERRY_TEST_PCH OR NOT TARGET ferry_test_pch)
    return()
  endif()
  foreach(source IN LISTS ARGN)
    get_filename_component(source "${source}" ABSOLUTE)
    get_filename_component(dir "${source}" DIRECTORY)
    set(files "${source}")
    file(STRINGS "${source}" quoted REGEX "^#include \"[^\"]+\"")
    foreach(line IN LISTS quoted)
      string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" header "${line}")
      if(EXISTS "${dir}/${header}")
        list(APPEND files "${dir}/${header}")
      endif()
    endforeach()
    foreach(file IN LISTS files)
      file(STRINGS "${file}" torch_all REGEX "^#include <torch/torch\\.h>")
      if(torch_all)
        target_precompile_headers(${target} REUSE_FROM ferry_test_pch)
        # A header GCC refuses (settings that differ from the host's) fails the build rather than
        # doubling its time without a word.
        target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror=invalid-pch>)
        return()
      endif()
    endforeach()
  endforeach()
endfunction()

# ferry_add_test(NAME SOURCES src... [LABELS l...] [LINK deps...])
# One gtest binary per test file; tests labelled `gpu` skip themselves without a GPU. Without
# FERRY_BUILD_GPU_TESTS a gpu-labelled binary is still defined (its folder may set its properties) but
# neither built by default nor added as a test.
function(ferry_add_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LABELS;LINK" ${ARGN})
  set(labels cpu)
  if(ARG_LABELS)
    set(labels ${ARG_LABELS})
  endif()
  set(not_built "")
  if("gpu" IN_LIST labels AND NOT FERRY_BUILD_GPU_TESTS)
    set(not_built EXCLUDE_FROM_ALL)
  endif()
  add_executable(${name} ${not_built} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ferry::ferry ferry_test_main ${ARG_LINK})
  ferry_target_defaults(${name})
  ferry_use_test_pch(${name} ${ARG_SOURCES})
  if(not_built)
    return()
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "${labels}")
  if("gpu" IN_LIST labels)
    # Without a GPU every test in the binary calls GTEST_SKIP: ctest then reports it as skipped, not
    # passed.
    set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
    # A GPU call has 10 minutes: a test that hangs (a collective, a wait for a copy) must fail within
    # a fraction of it, not take ctest's default 1500 s. They ran 6 s in all on the H100.
    set_tests_properties(${name} PROPERTIES TIMEOUT 180)
  endif()
  ferry_test_environment(${name})
endfunction()

# ferry_rerun_test(NAME BINARY VAR=value...): the test binary BINARY (a ferry_add_test target) run again
# as test NAME, labelled cpu, with the variables added to the environment (after the sanitizers').
function(ferry_rerun_test name binary)
  add_test(NAME ${name} COMMAND ${binary})
  ferry_test_environment(${name})
  set_tests_properties(${name} PROPERTIES LABELS cpu)
  set_property(TEST ${name} APPEND PROPERTY ENVIRONMENT ${ARGN})
endfunction()

# ferry_add_tests(name...): ferry_add_test(name SOURCES name.cpp) for each: the one-file tests of a
# folder, labelled cpu.
function(ferry_add_tests)
  foreach(name IN LISTS ARGN)
    ferry_add_test(${name} SOURCES ${name}.cpp)
  endforeach()
endfunction()
