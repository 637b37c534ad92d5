//! Semantics of the masked atomics (ConnectX "extended atomics"), as pure functions.
//!
//! Every transport applies these inside one 64-bit atomic step (a CAS loop where the hardware
//! has no masked atomics), so they are atomic against every other atomic on the region.
//!
//! * **Masked CAS**: the bits in `compare_mask` of the old value are compared with the same bits of
//!   `compare`; on a match, the bits in `swap_mask` are replaced by those of `swap`. The old value is
//!   returned either way. A zero compare mask always matches, so `swap = mask = bits` is an atomic OR
//!   and `swap = 0, mask = bits` an atomic AND-NOT.
//! * **Masked FAA**: the word is split into fields by `boundary`: each set bit marks the *lowest*
//!   bit of a field (bit 0 always starts one). `add` is added field by field; a carry out of a
//!   field's top bit is dropped, so fields wrap independently. `boundary = 0` is a plain 64-bit FAA.
//!   (ConnectX's own mask marks each field's *top* bit instead; the rdma transport translates with
//!   [`boundary_to_top_bits`].)

/// Result word of a masked compare-and-swap applied to `old`.
#[inline]
pub fn masked_cas(old: u64, compare: u64, compare_mask: u64, swap: u64, swap_mask: u64) -> u64 {
    if (old ^ compare) & compare_mask == 0 {
        (old & !swap_mask) | (swap & swap_mask)
    } else {
        old
    }
}

/// The top bit of every field described by a low-boundary mask.
#[inline]
pub fn boundary_to_top_bits(boundary: u64) -> u64 {
    (boundary >> 1) | (1 << 63)
}

/// Result word of a masked fetch-and-add applied to `old` (carry-less between fields).
#[inline]
pub fn masked_faa(old: u64, add: u64, boundary: u64) -> u64 {
    let top = boundary_to_top_bits(boundary);
    // Add everything below each field's top bit (a carry can reach the top bit but never leave
    // the field because the top bits are zero in both operands), then fold the top bits in by XOR.
    ((old & !top).wrapping_add(add & !top)) ^ ((old ^ add) & top)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference model: split into fields explicitly and add each modulo its width.
    fn faa_model(old: u64, add: u64, boundary: u64) -> u64 {
        let mut result = 0u64;
        let mut lo = 0u32;
        while lo < 64 {
            let mut hi = lo + 1;
            while hi < 64 && boundary & (1 << hi) == 0 {
                hi += 1;
            }
            let width = hi - lo;
            let mask = if width == 64 {
                u64::MAX
            } else {
                (1u64 << width) - 1
            };
            let field = ((old >> lo) & mask).wrapping_add((add >> lo) & mask) & mask;
            result |= field << lo;
            lo = hi;
        }
        result
    }

    proptest! {
        #[test]
        fn masked_faa_matches_field_model(old: u64, add: u64, boundary: u64) {
            prop_assert_eq!(masked_faa(old, add, boundary), faa_model(old, add, boundary));
        }

        #[test]
        fn masked_cas_touches_only_swap_mask(old: u64, c: u64, cm: u64, s: u64, sm: u64) {
            let new = masked_cas(old, c, cm, s, sm);
            prop_assert_eq!(new & !sm, old & !sm);
            if (old & cm) == (c & cm) { prop_assert_eq!(new & sm, s & sm); } else { prop_assert_eq!(new, old); }
        }
    }

    #[test]
    fn plain_faa_and_or() {
        assert_eq!(masked_faa(u64::MAX, 1, 0), 0);
        assert_eq!(masked_faa(0x00ff, 0x0001, 1 << 8), 0x0000);
        assert_eq!(masked_faa(0x00ff, 0x0101, 1 << 8), 0x0100);
        assert_eq!(masked_cas(0b1000, 0, 0, 0b0011, 0b0011), 0b1011);
    }
}
