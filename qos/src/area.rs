//! The QoS area: the words of a memory node's region that its QoS monitor and the mounts' QoS
//! engines share. Who writes what:
//!
//! | word | written by | read by |
//! |---|---|---|
//! | `PERIOD` | monitor, last at each period start | engines: a change starts their period |
//! | `POOL` | monitor: the global tokens it has not handed out yet (informational) | status |
//! | `REPORT` | monitor: 1 once global tokens are wanted | engines: report every δ while set |
//! | `ELAPSED_US` | monitor, every check interval | engines: prorate their reservation |
//! | `PERIOD_US`, `CHECK_US` | monitor, once | engines |
//! | slot `GRANT`, `LIMIT` | monitor, before `PERIOD` | engine of that slot |
//! | slot `REPORT_WORD` | engine of that slot (one-sided WRITE): residual reservation, reservation tokens spent | monitor |
//! | slot `USAGE` | engine of that slot, same batch: tokens asked for (demand), tokens spent | monitor (estimation, pShift, status) |
//! | slot `SHARE` | monitor adds the mount's share of the global pool by CAS; the engine takes tokens with a masked FAA of `-batch` on its token field | both |
//! | slot `WEIGHT` | monitor | status |
//!
//! The monitor's CAS on a share and its reset of it at a period's start are atomic with the
//! engines' claims even where the CPU's atomics are not atomic with RDMA ones (a device with
//! `atomic_cap` HCA): there they go through the node's NIC, by a loopback queue pair
//! (`Region::compare_swap`, `Region::store_shared`).
//!
//! A share word (and `POOL`) carries the period it belongs to in its top 16 bits and a signed
//! 48-bit token count below. A claim gets `min(batch, max(count, 0))` and may take the count
//! below zero: a negative share tells the monitor the mount wants global tokens. The masked
//! FAA keeps the fields apart, so the value a claim returns says exactly which period's tokens
//! it drew.

/// Mount slots per node (the same slot numbers as range-lock client slots).
pub const SLOTS: u64 = 64;
pub const PERIOD: u64 = 0;
pub const POOL: u64 = 8;
pub const REPORT: u64 = 16;
pub const ELAPSED_US: u64 = 24;
pub const PERIOD_US: u64 = 32;
pub const CHECK_US: u64 = 40;
const HEADER: u64 = 64;
const SLOT_LEN: u64 = 48;
/// Bytes of the area.
pub const AREA_LEN: u64 = HEADER + SLOTS * SLOT_LEN;

pub const GRANT: u64 = 0;
pub const LIMIT: u64 = 8;
pub const REPORT_WORD: u64 = 16;
pub const USAGE: u64 = 24;
pub const SHARE: u64 = 32;
pub const WEIGHT: u64 = 40;

const TOKEN_BITS: u32 = 48;
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;
/// Masked-FAA boundary of the pool word: the token field at bit 0, the period field at bit 48.
pub const POOL_BOUNDARY: u64 = 1 | 1 << TOKEN_BITS;

/// A pool word: `period` (mod 2^16) and a signed token count.
pub fn pack_pool(period: u64, tokens: i64) -> u64 {
    (period & 0xffff) << TOKEN_BITS | (tokens as u64 & TOKEN_MASK)
}

/// The period (mod 2^16) and the signed token count of a pool word.
pub fn unpack_pool(w: u64) -> (u64, i64) {
    let t = w & TOKEN_MASK;
    let signed = ((t << (64 - TOKEN_BITS)) as i64) >> (64 - TOKEN_BITS);
    (w >> TOKEN_BITS, signed)
}

/// The masked-FAA operand that takes `n` tokens from the pool word's token field.
pub fn pool_take(n: u64) -> u64 {
    n.wrapping_neg() & TOKEN_MASK
}

/// Offset of slot `c` within the area.
pub fn slot(c: u16) -> u64 {
    HEADER + c as u64 * SLOT_LEN
}

const COUNT_BITS: u32 = 28;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// A slot's report word: the period it describes (mod 256) and two 28-bit counts (saturating):
/// `REPORT_WORD` holds (residual reservation, reservation tokens spent), `USAGE` holds (tokens
/// asked for, tokens spent). The period tag lets the monitor ignore a report written late for
/// a period that has ended.
pub fn pack_pair(period: u64, hi: u64, lo: u64) -> u64 {
    (period & 0xff) << (2 * COUNT_BITS) | hi.min(COUNT_MASK) << COUNT_BITS | lo.min(COUNT_MASK)
}

/// The period tag and the two counts of a report word.
pub fn unpack_pair(w: u64) -> (u64, u64, u64) {
    (
        w >> (2 * COUNT_BITS),
        w >> COUNT_BITS & COUNT_MASK,
        w & COUNT_MASK,
    )
}

/// Tokens one one-sided data operation of `len` bytes costs: one per 4 KiB started.
pub fn tokens_for(len: u64) -> u64 {
    len.div_ceil(4096).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn report_words_round_trip(period in 0u64..256, a in 0u64..1 << 28, b in 0u64..1 << 28) {
            prop_assert_eq!(unpack_pair(pack_pair(period, a, b)), (period, a, b));
        }

        #[test]
        fn pool_words_round_trip_and_claims_keep_the_period(period in 0u64..1 << 16, tokens in -(1i64 << 40)..(1 << 40), n in 0u64..1 << 20) {
            let w = pack_pool(period, tokens);
            prop_assert_eq!(unpack_pool(w), (period, tokens));
            let after = rackfs_verbs::masked::masked_faa(w, pool_take(n), POOL_BOUNDARY);
            prop_assert_eq!(unpack_pool(after), (period, tokens - n as i64));
        }
    }
}
