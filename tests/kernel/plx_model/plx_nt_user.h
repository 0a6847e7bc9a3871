/* What kernel/plx_nt.c needs of the kernel, in userspace: its register accesses go to
 * the register model (plx_model.cpp) instead of MMIO. */
#ifndef PCIENTB_PLX_NT_USER_H
#define PCIENTB_PLX_NT_USER_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

typedef uint32_t u32;
typedef uint64_t u64;
#define __iomem

#ifdef __cplusplus
extern "C" {
#endif
u32 plx_rd(void *base, u32 off);
void plx_wr(void *base, u32 off, u32 val);
#ifdef __cplusplus
}
#endif

#endif
