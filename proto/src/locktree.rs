//! The lock-tree word of a file record, and the timing contract between mounts and the
//! lock-tree service (`rackfs_meta::locktree` states who writes which word of a tree).

use std::time::Duration;

/// How long a client may use a tree handle without seeing the tree live.
pub const CLIENT_LEASE: Duration = Duration::from_millis(500);
/// The least time a retired tree stays allocated: four client leases.
pub const MIN_GRACE: Duration = Duration::from_secs(2);

/// Tallest tree the service builds: `64 * 4^9` units of 4 KiB = 64 GiB, 2.7 MiB of tree.
/// Beyond that a file's ranges are covered by the tree's spillover mutex.
pub const MAX_HEIGHT: u32 = 9;

/// A published tree: `1 << 63 | height << 56 | offset` in the primary's region (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeWord(pub u64);

impl TreeWord {
    pub const NONE: TreeWord = TreeWord(0);

    /// The word of a tree of `height` at `offset`.
    pub fn new(height: u32, offset: u64) -> TreeWord {
        debug_assert!(offset < 1 << 56 && height < 128);
        TreeWord(1 << 63 | (height as u64) << 56 | offset)
    }

    /// The tree's height and offset, if there is one.
    pub fn tree(self) -> Option<(u32, u64)> {
        (self.0 >> 63 == 1).then_some(((self.0 >> 56 & 0x7f) as u32, self.0 & ((1 << 56) - 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn tree_word_round_trips(height in 0u32..=MAX_HEIGHT, offset in 0u64..(1 << 56)) {
            prop_assert_eq!(TreeWord::new(height, offset).tree(), Some((height, offset)));
        }
    }

    #[test]
    fn none_has_no_tree() {
        assert_eq!(TreeWord::NONE.tree(), None);
    }
}
