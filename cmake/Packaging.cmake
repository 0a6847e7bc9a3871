# cmake/Packaging.cmake: the Debian package "pcientb" (CPack, DEB generator).
#
#   scripts/package.sh [BUILD_DIR [OUT_DIR]]    (scripts/setup.sh --deb calls it)
#   cpack --config BUILD_DIR/CPackConfig.cmake -B OUT_DIR   (the same, by hand)
#
# One package holds what `cmake --install` installs: the provider and the driver file
# (component "provider"), the preload library ("preload"), the SDP socket layer
# ("sdp"), the man pages ("man"), and the rest ("Unspecified": the launchers,
# pcientb-perf, pcientb-stat, sockbench, plot.py, <pcientb/sdp.h>, sdp.conf).
# The socket layer is not a package of its own: it needs nothing the provider does
# not (libibverbs), does nothing until a program runs under pcientb-sdp (which runs
# pcientb-run), and its header, rules file and launcher are not in its component.
#
# A component group makes one package. A later package (the socket layer on its own,
# a DKMS kernel module) is a group of its own here, with its components and its
# CPACK_DEBIAN_<GROUP>_* settings; conffiles are listed per group. Components in no
# group (tests, benchmarks' build-only artifacts, should any get install rules) are
# not packaged; configuring warns about any component this file does not know.
#
# Included at the end of the top-level CMakeLists.txt, once every install rule is
# known. Registers the CTest test package.deb (label "package").

# --- Run by cpack (CPACK_PRE_BUILD_SCRIPTS) once the files are staged -------------
# Every file the package puts under /etc is a conffile (kept on remove, asked about
# on upgrade if edited): list them in this run's own control file "conffiles".
# Manual pages are compressed, as Debian's are (gzip -9n: reproducible).
if(NOT DEFINED PROJECT_NAME AND DEFINED CPACK_TEMPORARY_INSTALL_DIRECTORY)
  file(GLOB_RECURSE _staged LIST_DIRECTORIES false RELATIVE "${CPACK_TEMPORARY_INSTALL_DIRECTORY}"
       "${CPACK_TEMPORARY_INSTALL_DIRECTORY}/*")
  set(_groups "")
  foreach(_f IN LISTS _staged)
    # <group>/etc/... (one staging directory per package)
    if(_f MATCHES "^([^/]+)/(etc/.*)$")
      string(TOUPPER "${CMAKE_MATCH_1}" _g)
      list(APPEND _groups ${_g})
      string(APPEND _conffiles_${_g} "/${CMAKE_MATCH_2}\n")
    elseif(_f MATCHES "^[^/]+/usr/share/man/man[1-9]/[^/]+\\.[1-9]$")
      execute_process(COMMAND gzip -9nf "${CPACK_TEMPORARY_INSTALL_DIRECTORY}/${_f}"
                      RESULT_VARIABLE _rc)
      if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "gzip -9n ${_f} failed")
      endif()
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _groups)
  foreach(_g IN LISTS _groups)
    set(_dir "${CPACK_TOPLEVEL_DIRECTORY}/control-${_g}")
    file(MAKE_DIRECTORY "${_dir}")
    file(WRITE "${_dir}/conffiles" "${_conffiles_${_g}}")
    list(APPEND CPACK_DEBIAN_${_g}_PACKAGE_CONTROL_EXTRA "${_dir}/conffiles")
  endforeach()
  return()
endif()

include_guard(GLOBAL)

# libibverbs reads /etc/libibverbs.d and loads providers from its own
# <libdir>/libibverbs (Debian: /usr/lib/<multiarch>/libibverbs); the launchers carry
# the installed paths. A package is only right for a build configured for /usr.
if(NOT CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  message(STATUS "pcientb: no Debian package: CMAKE_INSTALL_PREFIX is "
                 "'${CMAKE_INSTALL_PREFIX}', the package needs /usr")
  return()
endif()

find_program(PCIENTB_DPKG_EXE dpkg)
if(NOT PCIENTB_DPKG_EXE)
  message(STATUS "pcientb: no Debian package: dpkg not found")
  return()
endif()
execute_process(COMMAND ${PCIENTB_DPKG_EXE} --print-architecture
  OUTPUT_VARIABLE _pcientb_deb_arch OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _pcientb_rc)
if(NOT _pcientb_rc EQUAL 0 OR _pcientb_deb_arch STREQUAL "")
  message(STATUS "pcientb: no Debian package: dpkg --print-architecture failed")
  return()
endif()

# --- What goes into which package ----------------------------------------------
set(PCIENTB_PACKAGE_COMPONENTS provider preload sdp man Unspecified)
get_cmake_property(_pcientb_components COMPONENTS)
foreach(_c IN LISTS _pcientb_components)
  if(NOT _c IN_LIST PCIENTB_PACKAGE_COMPONENTS)
    message(WARNING "pcientb: install component '${_c}' is in no Debian package "
                    "(cmake/Packaging.cmake): add it to a package or leave it out on purpose")
  endif()
endforeach()

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME pcientb)
set(CPACK_PACKAGE_VENDOR "pcientb")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_PACKAGE_CONTACT "pcientb dev <dev@pcientb.local>")
# Install rules with absolute destinations (/etc/...) are staged under DESTDIR: without
# this, cpack would write them to the real /etc.
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_THREADS 1)

set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_GROUPING ONE_PER_GROUP)
set(CPACK_COMPONENTS_ALL ${PCIENTB_PACKAGE_COMPONENTS})

set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT) # <name>_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE "${_pcientb_deb_arch}")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${CPACK_PACKAGE_CONTACT}")
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Depends: computed by dpkg-shlibdeps (libc6, libstdc++6, libgcc-s1, libibverbs1 with
# the version of the private provider ABI's symbols), plus what libibverbs needs to
# load a provider at all.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# The package's own libraries (the preload needs the provider, pcientb-perf the
# preload) are found in the build tree, not asked of installed packages.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${CMAKE_LIBRARY_OUTPUT_DIRECTORY}")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)

# The package "pcientb": every component above, in one group.
include(CPackComponent)
cpack_add_component_group(pcientb
  DESCRIPTION "RDMA verbs over PCIe NTB: provider, preload library, SDP socket layer, tools")
foreach(_c IN LISTS PCIENTB_PACKAGE_COMPONENTS)
  cpack_add_component(${_c} GROUP pcientb)
endforeach()
set(CPACK_DEBIAN_PCIENTB_PACKAGE_NAME pcientb)
set(CPACK_DEBIAN_PCIENTB_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PCIENTB_PACKAGE_DEPENDS "ibverbs-providers")
set(CPACK_DEBIAN_PCIENTB_PACKAGE_SUGGESTS
  "ibverbs-utils, perftest, rdmacm-utils, python3-matplotlib, openmpi-bin | mpich, ucx-utils")
# The synopsis is CPACK_PACKAGE_DESCRIPTION_SUMMARY; this is the extended description.
set(CPACK_DEBIAN_PCIENTB_DESCRIPTION
"pcientb is an rdma-core userspace provider (libpcientb-rdmav34.so, loaded by
the system libibverbs) that presents the device pcientb0 to ordinary verbs
programs. Without NTB hardware the same provider runs over an emulated fabric
between processes on one machine.

This package holds the provider and its driver file, the preload library and
the launcher pcientb-run (unmodified programs see pcientb0), pcientb-mpirun,
the SDP socket layer (libpcientb-sdp.so, pcientb-sdp, /etc/pcientb/sdp.conf),
the tools pcientb-perf, pcientb-stat and sockbench, and the manual pages.")

# Control files. The libraries in /usr/lib/<multiarch> need the dynamic linker's
# cache refreshed: the ldconfig trigger does it (as debhelper does), so the package
# has no maintainer script of its own; postinst and postrm are given only because
# CPack would otherwise add ones that run ldconfig directly.
# conffiles: written by this file when cpack runs it (CPACK_PRE_BUILD_SCRIPTS, above).
set(_pcientb_control "${CMAKE_BINARY_DIR}/cpack-deb")
file(WRITE "${_pcientb_control}/triggers" "activate-noawait ldconfig\n")
foreach(_script postinst postrm)
  file(WRITE "${_pcientb_control}/${_script}"
    "#!/bin/sh\n# pcientb ${_script}: nothing to do (the ldconfig trigger refreshes the linker cache)\nset -e\nexit 0\n")
endforeach()
set(CPACK_DEBIAN_PCIENTB_PACKAGE_CONTROL_EXTRA
  "${_pcientb_control}/triggers;${_pcientb_control}/postinst;${_pcientb_control}/postrm")
set(CPACK_PRE_BUILD_SCRIPTS "${CMAKE_CURRENT_LIST_FILE}")

include(CPack)

# --- Test: build the package, check its contents, install and purge it in a private
# dpkg root (never the system's) ----------------------------------------------------
add_test(NAME package.deb
  COMMAND ${CMAKE_COMMAND} -E env CPACK=${CMAKE_CPACK_COMMAND}
          bash ${PROJECT_SOURCE_DIR}/scripts/package.sh --test ${CMAKE_BINARY_DIR})
set_tests_properties(package.deb PROPERTIES LABELS package TIMEOUT 180 SKIP_RETURN_CODE 77)
