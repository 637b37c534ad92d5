//! Formats of remote memory that mounts and the metadata service both read and write: the file
//! record, the extent table and the stripe owner tag.
//!
//! Who writes which word (the invariants every client and the service keep):
//!
//! * a **file record** of [`RECORD_LEN`] bytes in the primary's region:
//!   - `size` ([`REC_SIZE`]): clients grow it with CAS-max after extending writes; the service
//!     sets it on truncate;
//!   - `mtime` in ns ([`REC_MTIME`]): clients write it after data writes, the service on
//!     truncate and setattr;
//!   - the extent table's offset and capacity ([`REC_TABLE`], [`REC_TABLE_CAP`]): only the
//!     service writes them, the table before the record, so a reader never sees a table that is
//!     not yet filled;
//!   - the stripe unit ([`REC_STRIPE`]) and inode number ([`REC_INO`]): written once at create;
//!   - the published lock tree ([`REC_LOCKS`], a [`crate::locktree::TreeWord`]): only the
//!     service writes it (see `rackfs_meta::locktree`).
//! * an **extent table**: per stripe index, [`ENTRY_LEN`] bytes `location, tag`, where
//!   location is [`location`]`(node, data offset)` and `tag` identifies the allocation (0: a
//!   hole). Only the service writes it: location then tag on allocation, tag then location on
//!   free. When a table grows it is copied and the old copy kept until the file is deleted,
//!   because clients may still read it; they re-check the record after reading entries.
//! * a **stripe owner tag**: the first 8 bytes of every stripe extent, [`TAG_SPACE`] before its
//!   data, written by the data node when it allocates the extent and tombstoned (0) when it is
//!   freed. A client reads the tag in the same batch as the stripe's data: a mismatch means its
//!   cached layout is stale and the operation is redone. Freed stripes are quarantined before
//!   reuse (`NodeAddr::quarantine_ms`), so a stale operation never touches another file's data
//!   as long as the batch runs within the quarantine of the moment the client last saw the
//!   stripe live (its tag matching, or its table entry present, which the service clears before
//!   freeing). A client therefore writes to a cached stripe only within half the quarantine of
//!   that moment, and otherwise checks the tag in a batch of its own first.

/// Bytes of a file record.
pub const RECORD_LEN: u64 = 64;
/// Record word: the file size.
pub const REC_SIZE: u64 = 0;
/// Record word: the modification time in ns.
pub const REC_MTIME: u64 = 8;
/// Record word: the extent table's offset in the primary's region.
pub const REC_TABLE: u64 = 16;
/// Record word: the extent table's capacity, in entries.
pub const REC_TABLE_CAP: u64 = 24;
/// Record word: the file's stripe unit in bytes.
pub const REC_STRIPE: u64 = 32;
/// Record word: the inode number.
pub const REC_INO: u64 = 40;
/// Record word: the published lock tree.
pub const REC_LOCKS: u64 = 48;
/// Bytes of one extent-table entry (`location`, `tag`).
pub const ENTRY_LEN: u64 = 16;
/// Bytes before a tagged (file stripe) extent's data: its tag lives in the first 8.
pub const TAG_SPACE: u64 = 4096;

/// An extent-table location word: `node << 48 | offset`.
pub fn location(node: u32, offset: u64) -> u64 {
    (node as u64) << 48 | offset
}

/// The node and offset of a location word.
pub fn split_location(word: u64) -> (u32, u64) {
    ((word >> 48) as u32, word & ((1 << 48) - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn locations_round_trip(node in 0u32..(1 << 16), offset in 0u64..(1 << 48)) {
            prop_assert_eq!(split_location(location(node, offset)), (node, offset));
        }
    }
}
