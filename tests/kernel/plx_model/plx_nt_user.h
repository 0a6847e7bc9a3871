/* What kernel/plx_nt.c and plx_dma.c need of the kernel, in userspace: their register
 * accesses go to the register model (plx_model.cpp) instead of MMIO. x86: little-endian,
 * and a compiler barrier orders stores as the kernel's wmb() does for coherent memory. */
#ifndef PCIENTB_PLX_NT_USER_H
#define PCIENTB_PLX_NT_USER_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef uint16_t __le16;
typedef uint32_t __le32;
#define __iomem
#define cpu_to_le16(v) ((uint16_t)(v))
#define cpu_to_le32(v) ((uint32_t)(v))
#define le32_to_cpu(v) ((uint32_t)(v))
#define wmb() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define rmb() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define READ_ONCE(x) (*(const volatile __typeof__(x) *)&(x))
#define WRITE_ONCE(x, v) (*(volatile __typeof__(x) *)&(x) = (v))

#ifdef __cplusplus
extern "C" {
#endif
u32 plx_rd(void *base, u32 off);
void plx_wr(void *base, u32 off, u32 val);
u16 plx_rd16(void *base, u32 off);
void plx_wr16(void *base, u32 off, u16 val);
void plx_delay_us(unsigned int us);
#ifdef __cplusplus
}
#endif

#endif
