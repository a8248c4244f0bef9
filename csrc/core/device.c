/* device.c — the device figures a caller who knows no device gets: one table (an H100 SXM, what
 * generate() without a GPU targets), and how a schedule decision fills in what a device does
 * not say. */
#include "core/internal.h"

/* sm, SMs, shared memory per block (with opt-in), registers per SM, L2 */
static const kb_device_info H100_SXM = {90, 132, 227 * 1024, 65536, 50 * 1024 * 1024};

const kb_device_info *kb_device_default(void) { return &H100_SXM; }

kb_device_info kb_device_for_schedule(const kb_device_info *dev) {
    kb_device_info d = dev ? *dev : (kb_device_info){0, 0, 0, 0, 0};
    if (d.sm <= 0) d.sm = H100_SXM.sm;
    if (d.num_sms <= 0) d.num_sms = H100_SXM.num_sms;
    if (d.max_smem_per_block <= 0) d.max_smem_per_block = KB_SMEM_PORTABLE;
    if (d.regs_per_sm <= 0) d.regs_per_sm = H100_SXM.regs_per_sm;
    if (d.l2_bytes <= 0) d.l2_bytes = H100_SXM.l2_bytes;
    return d;
}
