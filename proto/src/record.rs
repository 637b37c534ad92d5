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
//!     service writes it (see `rackfs_meta::locktree`);
//!   - the replication factor `r` ([`REC_REPLICAS`], 0 read as 1): written once at create.
//! * an **extent table**: per stripe index, an entry of `r` slots ([`entry_offset`]), one per
//!   replica, each [`ENTRY_LEN`] bytes `location, tag`, where location is
//!   [`location`]`(node, data offset)` and `tag` identifies the allocation (all replicas of a
//!   stripe share it; 0: an empty slot, and a stripe with every slot empty is a hole). The
//!   replicas of a stripe are on different nodes and hold the same bytes: a write goes to every
//!   replica in the entry, a read to any one. Only the service writes the table: location then
//!   tag when it places a replica, tag then location when it frees or drops one, and only the
//!   tag ([`TAG_MOVING`]) while it moves or copies the stripe (a replica on
//!   a node declared dead is dropped from the entry; the last replica of a stripe is never
//!   dropped, so a stripe whose every replica is gone fails rather than reading as a hole). When a table grows it is copied and the old copy kept until the file is deleted,
//!   because clients may still read it; they re-check the record after reading entries.
//! * a **stripe owner tag**: the first 8 bytes of every stripe extent, [`TAG_SPACE`] before its
//!   data, written by the data node when it allocates the extent and tombstoned (0) when it is
//!   freed or moved. The tag also states the extent's capacity ([`stripe_tag`]): a stripe's
//!   extent holds only the bytes written so far (small files and tails take little memory), and
//!   bytes of the stripe beyond the capacity read as zeros. To grow an extent the service clears
//!   its table entry, then its data node allocates a larger one, tombstones the old tag, copies
//!   the data and quarantines the old extent; only then is the new entry published. Clients
//!   read a stripe's tag *after* the batch's data ops on it (the node executes a batch in order,
//!   with a full fence between ops), so a write whose check finds the tag live landed before the
//!   tombstone and therefore before the copy: it is never lost, and one that finds it dead is
//!   redone. A client reads the tag in the same batch as the stripe's data: a mismatch means its
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
/// Record word: the replication factor (0 is 1).
pub const REC_REPLICAS: u64 = 56;
/// Most replicas a file may have.
pub const MAX_REPLICAS: u32 = 4;
/// Bytes of one extent-table slot (`location`, `tag`); an entry has one per replica.
pub const ENTRY_LEN: u64 = 16;
/// Bytes before a tagged (file stripe) extent's data: its tag lives in the first 8.
pub const TAG_SPACE: u64 = 64;
/// Stripe extents' capacities are multiples of this many bytes.
pub const EXTENT_GRANULE: u64 = 64;
/// A slot's tag while the service moves or re-replicates its stripe (never a real tag: its
/// capacity would exceed any stripe unit). A mount that finds it asks the service for the
/// stripe (`MetaRequest::GetStripe`), which answers once the move is done.
pub const TAG_MOVING: u64 = u64::MAX;
/// Low bits of a tag that number the allocation; the bits above hold the capacity.
const TAG_SERIAL_BITS: u32 = 40;

/// The owner tag of allocation number `serial` holding `cap` data bytes (a multiple of
/// [`EXTENT_GRANULE`], at least one): never 0, and different for extents of different sizes.
pub fn stripe_tag(serial: u64, cap: u64) -> u64 {
    debug_assert!(cap >= EXTENT_GRANULE && cap.is_multiple_of(EXTENT_GRANULE));
    (cap / EXTENT_GRANULE) << TAG_SERIAL_BITS | (serial & ((1 << TAG_SERIAL_BITS) - 1))
}

/// The serial number in owner tag `tag` (the service numbers each allocation, move and
/// retag; a later one has a larger serial).
pub fn tag_serial(tag: u64) -> u64 {
    tag & ((1 << TAG_SERIAL_BITS) - 1)
}

/// The data bytes an extent with owner tag `tag` holds.
pub fn tag_capacity(tag: u64) -> u64 {
    (tag >> TAG_SERIAL_BITS) * EXTENT_GRANULE
}

/// Offset of stripe `stripe`'s entry in an extent table at `table` of a file with `replicas`
/// replicas (its slot `j` is `j *` [`ENTRY_LEN`] further).
pub fn entry_offset(table: u64, stripe: u64, replicas: u32) -> u64 {
    table + stripe * replicas.max(1) as u64 * ENTRY_LEN
}

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

        #[test]
        fn tags_carry_their_capacity(serial in 1u64..(1 << 40), granules in 1u64..=(1 << 20)) {
            let cap = granules * EXTENT_GRANULE;
            let t = stripe_tag(serial, cap);
            prop_assert_ne!(t, 0);
            prop_assert_eq!(tag_capacity(t), cap);
            prop_assert_ne!(t, stripe_tag(serial, cap + EXTENT_GRANULE));
        }
    }
}
