# Helpers that give every ferry target the same flags.

set_property(GLOBAL PROPERTY FERRY_COMPONENT_TARGETS "")

# Flags for ferry's own code: warnings, sanitizers. Torch headers come in as -isystem, so their
# warnings stay out of the way.
function(ferry_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Werror=switch -Werror=return-type>)
  if(FERRY_SANITIZE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined>)
    get_target_property(type ${target} TYPE)
    if(NOT type STREQUAL "OBJECT_LIBRARY")
      target_link_options(${target} PRIVATE -fsanitize=address,undefined)
    endif()
  endif()
endfunction()

# ferry_add_component(NAME SOURCES src... [LINK deps...] [NO_TORCH])
# One OBJECT library per source folder; its objects go into libferry.so.
function(ferry_add_component name)
  cmake_parse_arguments(ARG "NO_TORCH" "" "SOURCES;LINK" ${ARGN})
  add_library(${name} OBJECT ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${FERRY_BUILD_INCLUDE_DIR}>)
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
  set_property(GLOBAL APPEND PROPERTY FERRY_COMPONENT_TARGETS ${name})
endfunction()

# ferry_add_test(NAME SOURCES src... [LABELS l...] [LINK deps...])
# One gtest binary per test file; tests labelled `gpu` skip themselves without a GPU.
function(ferry_add_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LABELS;LINK" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ferry::ferry ferry_test_main ${ARG_LINK})
  ferry_target_defaults(${name})
  add_test(NAME ${name} COMMAND ${name})
  set(labels cpu)
  if(ARG_LABELS)
    set(labels ${ARG_LABELS})
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${labels}")
  if("gpu" IN_LIST labels)
    # Without a GPU every test in the binary calls GTEST_SKIP: ctest then reports it as skipped, not
    # passed.
    set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
    # A GPU call has 10 minutes: a test that hangs (a collective, a wait for a copy) must fail within
    # a fraction of it, not take ctest's default 1500 s. They ran 6 s in all on the H100.
    set_tests_properties(${name} PROPERTIES TIMEOUT 180)
  endif()
  if(FERRY_SANITIZE)
    # torch's own allocations are not ours to judge; CUDA needs the shadow gap left alone.
    set_tests_properties(${name} PROPERTIES ENVIRONMENT
      "ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0;UBSAN_OPTIONS=print_stacktrace=1")
  endif()
endfunction()
