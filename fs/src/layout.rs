//! How a byte range of a file maps onto its stripes.

/// One contiguous part of an I/O inside a single stripe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Stripe index (file offset / stripe unit).
    pub stripe: u64,
    /// Offset inside the stripe.
    pub offset: u64,
    pub len: u64,
    /// Offset of this piece inside the caller's buffer.
    pub buf_offset: u64,
}

/// Splits `[offset, offset + len)` at stripe boundaries.
pub fn pieces(offset: u64, len: u64, unit: u64) -> Vec<Piece> {
    assert!(unit > 0, "stripe unit must be positive");
    let mut out = Vec::with_capacity((len / unit + 2) as usize);
    let mut at = offset;
    let end = offset + len;
    while at < end {
        let stripe = at / unit;
        let in_off = at % unit;
        let n = (unit - in_off).min(end - at);
        out.push(Piece {
            stripe,
            offset: in_off,
            len: n,
            buf_offset: at - offset,
        });
        at += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pieces_tile_the_range(offset in 0u64..1 << 40, len in 0u64..1 << 22, unit_pages in 1u64..64) {
            let unit = unit_pages * 4096;
            let ps = pieces(offset, len, unit);
            let mut expect = 0;
            for p in &ps {
                prop_assert_eq!(p.buf_offset, expect);
                prop_assert!(p.len > 0 && p.offset + p.len <= unit);
                prop_assert_eq!(p.stripe * unit + p.offset, offset + p.buf_offset);
                expect += p.len;
            }
            prop_assert_eq!(expect, len);
            // Only the first and last piece may be partial.
            for p in ps.iter().skip(1).take(ps.len().saturating_sub(2)) {
                prop_assert_eq!((p.offset, p.len), (0, unit));
            }
        }
    }
}
