# pcientb_add_test(): register a CTest test that runs on its own emulated fabric.
#
#   pcientb_add_test(NAME <name> COMMAND <cmd> [args...]
#                    [PRELOAD]            # run under pcientb-run (LD_PRELOAD of
#                                         # libpcientb-preload.so): for unmodified
#                                         # verbs programs (ibv_devinfo, perftest, ...)
#                    [FABRIC <fabric>]    # default: pcientb_test_fabric(<name>)
#                    [TIMEOUT <seconds>]  # default: 120
#                    [LABELS <label>...]
#                    [ENVIRONMENT <VAR=value>...])
#
# Each test gets its own fabric name (PCIENTB_FABRIC) so that `ctest -j` never lets
# two tests see each other's nodes. <cmd> may be a target name, as in add_test().
#
#   pcientb_test_fabric(<out-var> <name>)
#
# The fabric of test <name>: "ct<build>_<name>" (as an identifier), where <build> names
# this build tree, so that the tests of two trees (worktrees, presets) run at once on one
# machine never meet either.

include_guard(GLOBAL)

function(pcientb_test_fabric out name)
  string(SHA1 _tree "${CMAKE_BINARY_DIR}")
  string(SUBSTRING "${_tree}" 0 6 _tree)
  string(MAKE_C_IDENTIFIER "ct${_tree}_${name}" _fabric)
  set(${out} "${_fabric}" PARENT_SCOPE)
endfunction()

function(pcientb_add_test)
  cmake_parse_arguments(PARSE_ARGV 0 arg "PRELOAD" "NAME;FABRIC;TIMEOUT"
                        "COMMAND;LABELS;ENVIRONMENT")
  if(NOT arg_NAME OR NOT arg_COMMAND)
    message(FATAL_ERROR "pcientb_add_test: NAME and COMMAND are required")
  endif()
  if(NOT arg_FABRIC)
    pcientb_test_fabric(arg_FABRIC "${arg_NAME}")
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 120)
  endif()

  set(_cmd ${arg_COMMAND})
  set(_env "PCIENTB_FABRIC=${arg_FABRIC}" ${arg_ENVIRONMENT})
  if(arg_PRELOAD)
    if(NOT TARGET pcientb_preload)
      message(FATAL_ERROR "pcientb_add_test(${arg_NAME} PRELOAD): target pcientb_preload "
                          "does not exist (providers/pcientb not built?)")
    endif()
    # A target name as the command only works in first position: resolve it here.
    list(GET _cmd 0 _exe)
    if(TARGET ${_exe})
      list(REMOVE_AT _cmd 0)
      list(PREPEND _cmd "$<TARGET_FILE:${_exe}>")
    endif()
    list(PREPEND _cmd "${PCIENTB_RUN}" --fabric "${arg_FABRIC}")
    list(APPEND _env "PCIENTB_PRELOAD=$<TARGET_FILE:pcientb_preload>")
  endif()

  add_test(NAME ${arg_NAME} COMMAND ${_cmd})
  set_tests_properties(${arg_NAME} PROPERTIES TIMEOUT ${arg_TIMEOUT} ENVIRONMENT "${_env}")
  if(arg_LABELS)
    set_tests_properties(${arg_NAME} PROPERTIES LABELS "${arg_LABELS}")
  endif()
endfunction()
