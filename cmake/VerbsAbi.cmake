# Detect the libibverbs the provider is built against and its private provider ABI.
#
# A userspace provider registers itself with verbs_register_driver_<N>(), exported
# by libibverbs.so.1 under the version node IBVERBS_PRIVATE_<N>. The struct layouts
# the provider declares itself (libibverbs does not install driver.h) are only valid
# for the ABI they were written for, so the build refuses any other.
#
# Defines:
#   IBVerbs::ibverbs            imported target (headers + libibverbs.so)
#   PCIENTB_VERBS_PRIVATE_ABI   the detected private ABI number (e.g. 34)
#   PCIENTB_PROVIDER_SUFFIX     "rdmav<N>", the suffix libibverbs expects in
#                               lib<name>-rdmav<N>.so
#   PCIENTB_IBVERBS_VERSION     pkg-config version of libibverbs, if known

include_guard(GLOBAL)
include(CheckCSourceCompiles)
include(CMakePushCheckState)

set(PCIENTB_SUPPORTED_VERBS_PRIVATE_ABIS 34)

find_path(IBVERBS_INCLUDE_DIR infiniband/verbs.h)
find_library(IBVERBS_LIBRARY NAMES ibverbs)
if(NOT IBVERBS_INCLUDE_DIR OR NOT IBVERBS_LIBRARY)
  message(FATAL_ERROR
    "libibverbs development files not found (infiniband/verbs.h: '${IBVERBS_INCLUDE_DIR}', "
    "libibverbs.so: '${IBVERBS_LIBRARY}'). On Debian: apt-get install libibverbs-dev "
    "(or run scripts/setup.sh).")
endif()

find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PC_IBVERBS QUIET libibverbs)
  set(PCIENTB_IBVERBS_VERSION "${PC_IBVERBS_VERSION}")
endif()

# Private ABI versions exported by the library, read from its dynamic symbol table.
get_filename_component(_pcientb_ibverbs_real "${IBVERBS_LIBRARY}" REALPATH)
set(_pcientb_abis "")
if(NOT CMAKE_OBJDUMP)
  find_program(CMAKE_OBJDUMP objdump)
endif()
if(CMAKE_OBJDUMP)
  execute_process(
    COMMAND "${CMAKE_OBJDUMP}" -T "${_pcientb_ibverbs_real}"
    OUTPUT_VARIABLE _pcientb_dynsyms
    ERROR_VARIABLE _pcientb_objdump_err
    RESULT_VARIABLE _pcientb_objdump_rc)
  if(_pcientb_objdump_rc EQUAL 0)
    string(REGEX MATCHALL "IBVERBS_PRIVATE_[0-9]+[ \t]+verbs_register_driver_[0-9]+"
           _pcientb_reg_syms "${_pcientb_dynsyms}")
    foreach(_sym IN LISTS _pcientb_reg_syms)
      string(REGEX REPLACE "^IBVERBS_PRIVATE_([0-9]+).*$" "\\1" _abi "${_sym}")
      list(APPEND _pcientb_abis ${_abi})
    endforeach()
    list(REMOVE_DUPLICATES _pcientb_abis)
  else()
    message(WARNING "pcientb: '${CMAKE_OBJDUMP} -T ${_pcientb_ibverbs_real}' failed: "
                    "${_pcientb_objdump_err}")
  endif()
endif()

# Whatever objdump said, the registration entry point must really link.
set(_pcientb_linkable "")
foreach(_abi IN LISTS PCIENTB_SUPPORTED_VERBS_PRIVATE_ABIS)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_QUIET ON)
  set(CMAKE_REQUIRED_INCLUDES "${IBVERBS_INCLUDE_DIR}")
  set(CMAKE_REQUIRED_LIBRARIES "${IBVERBS_LIBRARY}")
  check_c_source_compiles("
    #include <infiniband/verbs.h>
    struct verbs_device_ops;
    void verbs_register_driver_${_abi}(const struct verbs_device_ops *ops);
    int main(int argc, char **argv) {
      (void)argv;
      if (argc > 1000) verbs_register_driver_${_abi}(0);
      return 0;
    }" PCIENTB_HAVE_VERBS_REGISTER_DRIVER_${_abi})
  cmake_pop_check_state()
  if(PCIENTB_HAVE_VERBS_REGISTER_DRIVER_${_abi})
    list(APPEND _pcientb_linkable ${_abi})
  endif()
endforeach()

set(_pcientb_found_desc "${_pcientb_abis}")
if(NOT _pcientb_found_desc)
  set(_pcientb_found_desc "none (no IBVERBS_PRIVATE_<N> verbs_register_driver_<N> symbol)")
endif()
set(PCIENTB_VERBS_PRIVATE_ABI "")
foreach(_abi IN LISTS _pcientb_linkable)
  if(NOT _pcientb_abis OR _abi IN_LIST _pcientb_abis)
    set(PCIENTB_VERBS_PRIVATE_ABI ${_abi})
  endif()
endforeach()
if(NOT PCIENTB_VERBS_PRIVATE_ABI)
  message(FATAL_ERROR
    "Unsupported libibverbs: ${_pcientb_ibverbs_real} (pkg-config version "
    "'${PCIENTB_IBVERBS_VERSION}') exports private provider ABI: ${_pcientb_found_desc}. "
    "pcientb supports private ABI ${PCIENTB_SUPPORTED_VERBS_PRIVATE_ABIS} only "
    "(IBVERBS_PRIVATE_34: rdma-core v43 to v46, as in Debian 12). Build against such a "
    "libibverbs, or port providers/pcientb/glue to the new ABI first.")
endif()

set(PCIENTB_PROVIDER_SUFFIX "rdmav${PCIENTB_VERBS_PRIVATE_ABI}")
message(STATUS "pcientb: libibverbs ${PCIENTB_IBVERBS_VERSION} at ${_pcientb_ibverbs_real}, "
               "private ABI ${PCIENTB_VERBS_PRIVATE_ABI}")

if(NOT TARGET IBVerbs::ibverbs)
  add_library(IBVerbs::ibverbs UNKNOWN IMPORTED)
  set_target_properties(IBVerbs::ibverbs PROPERTIES
    IMPORTED_LOCATION "${IBVERBS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${IBVERBS_INCLUDE_DIR}")
endif()
