//! A data node's memory of the tag changes primaries made to its stripe extents, so that a
//! primary that takes over can find where each extent its tables list went.
//!
//! A primary moves an extent (`Resize`: a stripe grows) or gives it a new tag in place
//! (`Retag`: re-replication) under its metadata lock, and its standby learns of the change
//! only with the journal sent after that. A primary that dies in between leaves a standby whose
//! tables list the extent as it was: tombstoned, or under a tag it no longer has, so every
//! read of the stripe would fail its tag check (`EIO`). The data node therefore keeps, per
//! extent, the tag it had before its last retag, and keeps a moved extent's old copy (and
//! where it went) until a primary frees it; the primary that takes over asks
//! ([`rackfs_proto::control::ControlRequest::Resolve`]) and points its tables at what the node
//! holds now. Moving forward, never back, keeps every write a mount made to the new extent
//! meanwhile. Both records go when the extent is freed, before its memory can be reused.

use std::collections::HashMap;

use rackfs_proto::control::Resolved;

/// Moves and retags of one node's stripe extents, by base offset.
#[derive(Debug, Default)]
pub struct TagHistory {
    /// An extent's tag before its last retag.
    retagged: HashMap<u64, u64>,
    /// An extent moved away: (its tag then, the new extent's base, the new extent's tag).
    moved: HashMap<u64, (u64, u64, u64)>,
}

/// Longest chain of moves and retags followed (each link is a change a dead primary made
/// without its standby knowing; more than one is already rare).
const MAX_LINKS: usize = 8;

impl TagHistory {
    /// Extent `base`, tagged `old`, was retagged in place.
    pub fn retagged(&mut self, base: u64, old: u64) {
        self.retagged.insert(base, old);
    }

    /// Extent `base`, tagged `old`, was moved to extent `to`, tagged `tag`; its memory stays
    /// held until [`TagHistory::forget`].
    pub fn moved(&mut self, base: u64, old: u64, to: u64, tag: u64) {
        self.moved.insert(base, (old, to, tag));
    }

    /// Whether `base` is an extent tagged `tag` that was moved away and is still held.
    pub fn moved_from(&self, base: u64, tag: u64) -> bool {
        self.moved.get(&base).is_some_and(|m| m.0 == tag)
    }

    /// Extent `base` is freed: whatever was recorded of it goes.
    pub fn forget(&mut self, base: u64) {
        self.retagged.remove(&base);
        self.moved.remove(&base);
    }

    /// Where extent `base`, tagged `tag`, is now: following its moves and retags to a live
    /// extent (`live(base)`: the tag of the live stripe extent at `base`, if any), or `None`.
    pub fn follow(
        &self,
        mut base: u64,
        mut tag: u64,
        live: impl Fn(u64) -> Option<u64>,
    ) -> Option<(u64, u64)> {
        for _ in 0..=MAX_LINKS {
            let now = live(base);
            if now == Some(tag) {
                return Some((base, tag));
            }
            if let Some(&(old, to, new)) = self.moved.get(&base) {
                if old == tag {
                    (base, tag) = (to, new);
                    continue;
                }
            }
            match now {
                Some(t) if self.retagged.get(&base) == Some(&tag) => tag = t,
                _ => return None,
            }
        }
        None
    }

    /// The answer to a `Resolve` of `asked` (base, tag) pairs.
    pub fn resolve(&self, asked: &[(u64, u64)], live: impl Fn(u64) -> Option<u64>) -> Resolved {
        let changed = asked
            .iter()
            .filter_map(|&(base, tag)| {
                let now = self.follow(base, tag, &live);
                (now != Some((base, tag))).then_some(((base, tag), now))
            })
            .collect();
        let mut moved: Vec<(u64, u64)> = self.moved.iter().map(|(&b, m)| (b, m.0)).collect();
        moved.sort_unstable();
        Resolved { changed, moved }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_then_a_retag_is_followed_to_the_extent_live_now() {
        let mut h = TagHistory::default();
        let tags: HashMap<u64, u64> = [(0x2000, 7)].into();
        let live = |b| tags.get(&b).copied();
        h.moved(0x1000, 5, 0x2000, 6);
        h.retagged(0x2000, 6);
        assert_eq!(h.follow(0x1000, 5, live), Some((0x2000, 7)));
        assert_eq!(h.follow(0x2000, 7, live), Some((0x2000, 7)));
        // A tag the extent never had is not followed: the memory is someone else's.
        assert_eq!(h.follow(0x1000, 4, live), None);
        assert_eq!(h.follow(0x2000, 9, live), None);
        let r = h.resolve(&[(0x1000, 5), (0x2000, 7), (0x3000, 1)], live);
        assert_eq!(
            r.changed,
            vec![((0x1000, 5), Some((0x2000, 7))), ((0x3000, 1), None)]
        );
        assert_eq!(r.moved, vec![(0x1000, 5)]);
        assert!(h.moved_from(0x1000, 5) && !h.moved_from(0x1000, 6));
        h.forget(0x1000);
        assert_eq!(h.follow(0x1000, 5, live), None);
        assert!(h.resolve(&[], live).moved.is_empty());
    }
}
