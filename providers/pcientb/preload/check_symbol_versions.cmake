# cmake -DPRELOAD=<libpcientb-preload.so> -DOBJDUMP=<objdump> -DPRIVATE_ABI=<N> -P this
# Fails unless every interposer is exported with the version of the symbol it
# replaces (libibverbs' or glibc's).
set(expected
  "IBVERBS_1.0 ibv_create_comp_channel"
  "IBVERBS_1.0 ibv_destroy_comp_channel"
  "IBVERBS_1.1 ibv_get_device_list"
  "IBVERBS_1.1 ibv_free_device_list"
  "IBVERBS_1.1 ibv_get_device_guid"
  "IBVERBS_1.1 ibv_query_gid"
  "IBVERBS_1.1 ibv_query_pkey"
  "IBVERBS_1.5 ibv_get_pkey_index"
  "IBVERBS_1.9 ibv_get_device_index"
  "IBVERBS_1.10 ibv_import_device"
  "IBVERBS_1.11 _ibv_query_gid_ex"
  "IBVERBS_1.11 _ibv_query_gid_table"
  "IBVERBS_PRIVATE_${PRIVATE_ABI} ibv_query_gid_type"
  "GLIBC_2.2.5 access"
  "GLIBC_2.2.5 __xstat"
  "GLIBC_2.2.5 __xstat64"
  "GLIBC_2.33 stat"
  "GLIBC_2.33 stat64"
  "GLIBC_2.2.5 __fxstat"
  "GLIBC_2.2.5 __fxstat64"
  "GLIBC_2.2.5 open"
  "GLIBC_2.2.5 open64"
  "GLIBC_2.2.5 write"
  "GLIBC_2.2.5 close"
  "GLIBC_2.4 openat"
  "GLIBC_2.4 openat64"
  "GLIBC_2.33 fstat"
  "GLIBC_2.33 fstat64")
if(NOT OBJDUMP)
  set(OBJDUMP objdump)
endif()
execute_process(COMMAND "${OBJDUMP}" -T "${PRELOAD}" OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${OBJDUMP} -T ${PRELOAD} failed")
endif()
set(missing "")
foreach(pair IN LISTS expected)
  string(REPLACE " " ";" parts "${pair}")
  list(GET parts 0 version)
  list(GET parts 1 name)
  string(REPLACE "." "\\." version_re "${version}")
  # Defined (section .text), default version (no parentheses).
  if(NOT out MATCHES "\\.text[^\n]*[ \t]${version_re}[ \t]+${name}\n")
    list(APPEND missing "${name}@@${version}")
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "libpcientb-preload.so does not export: ${missing}\n${out}")
endif()
list(LENGTH expected n)
message(STATUS "all ${n} interposers carry libibverbs' versions")
