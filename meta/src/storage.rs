//! What the metadata service needs from the node it runs on, and an in-memory stand-in.
//!
//! The service never opens a socket, starts a thread or reads a clock: memory on the data
//! nodes, its own region and time all come through [`Storage`]. The daemon implements it over
//! its allocator and its peers' control connections; [`MemStorage`] implements it in process
//! for tests, with a clock the test moves.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rackfs_proto::control::{ErrorCode, FsStat, Resolved};
use rackfs_proto::record::TAG_SPACE;
use rackfs_proto::space::NodeSpace;
use rackfs_proto::Refusal;
use rackfs_verbs::{Access, Region};

use crate::history::TagHistory;

/// The service's view of its node and cluster.
pub trait Storage: Send + Sync {
    /// Ids of the nodes that hold file data, this one included.
    fn data_nodes(&self) -> Vec<u32>;
    /// How many data nodes the cluster has, those down included.
    fn cluster_size(&self) -> usize;
    /// Allocates `len` bytes on `node`. A tagged extent is a file stripe: its tag is written in
    /// its first 8 bytes and its data starts [`TAG_SPACE`] after the returned offset.
    fn alloc(&self, node: u32, len: u64, tag: Option<u64>) -> Result<u64, Refusal>;
    /// Allocates one stripe extent of `len` data bytes on `node` per tag of `tags`, as
    /// [`Storage::alloc`] would; returns the base offsets of as many as fit (at least one), in
    /// order. A node elsewhere does it in one round trip.
    fn alloc_many(&self, node: u32, len: u64, tags: &[u64]) -> Result<Vec<u64>, Refusal> {
        let mut out = Vec::with_capacity(tags.len());
        for &t in tags {
            match self.alloc(node, len, Some(t)) {
                Ok(base) => out.push(base),
                Err(e) if out.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        Ok(out)
    }
    /// Frees the extent at `offset` on `node` (a stripe is tombstoned and quarantined; a
    /// stripe extent moved away by [`Storage::resize`] is freed with the tag it had).
    ///
    /// Every call on a stripe extent names the owner tag the service expects there (`tag`
    /// here, `expect` below) and is refused if the extent no longer carries it: a primary that
    /// took over from a standby whose layout lacks a change its predecessor died in must never
    /// touch memory a data node reused since.
    fn free(&self, node: u32, offset: u64, tag: Option<u64>) -> Result<(), Refusal>;
    /// Moves the stripe extent at `offset` on `node`, tagged `expect`, into a new one of `len`
    /// data bytes tagged `tag` on the same node, copying its data (`ControlRequest::Resize`);
    /// returns the new extent's offset. The old extent stays held (tombstoned) until freed.
    fn resize(
        &self,
        node: u32,
        offset: u64,
        len: u64,
        tag: u64,
        expect: u64,
    ) -> Result<u64, Refusal>;
    /// Zeroes `len` bytes at `offset` of the stripe extent tagged `expect` on `node`.
    fn zero(&self, node: u32, offset: u64, len: u64, expect: u64) -> Result<(), Refusal>;
    /// Gives the stripe extent at `offset` on `node`, tagged `expect`, the tag `tag`, in place.
    fn retag(&self, node: u32, offset: u64, expect: u64, tag: u64) -> Result<(), Refusal>;
    /// Copies `len` bytes from `from` (data of a stripe extent tagged `expect`) on node `src`
    /// to `to` on node `dst`.
    fn copy(
        &self,
        src: u32,
        from: u64,
        expect: u64,
        dst: u32,
        to: u64,
        len: u64,
    ) -> Result<(), Refusal>;
    /// What `node` holds now where stripe extents (base offset, tag) were: see
    /// [`crate::history`] (`ControlRequest::Resolve`).
    fn resolve(&self, node: u32, extents: &[(u64, u64)]) -> Result<Resolved, Refusal>;
    /// Node `node`'s failure domain (`None`: a domain of its own).
    fn domain(&self, node: u32) -> Option<String>;
    /// This node's id and data region (where records, tables and lock trees live).
    fn local(&self) -> (u32, &Region);
    /// Allocates `len` bytes of this node's metadata area (file records and extent tables:
    /// the part of the region a standby mirrors at the same offsets).
    fn meta_alloc(&self, len: u64) -> Result<u64, Refusal>;
    /// Frees the `len` bytes [`Storage::meta_alloc`] gave at `offset` (zeroed, as a standby
    /// zeroes its mirror of them).
    fn meta_free(&self, offset: u64, len: u64);
    /// A word of the local region that mounts write one-sidedly (a record's size or mtime).
    /// The service reads such words only through here, so a standby replaying its steps sees
    /// what it saw.
    fn load(&self, offset: u64) -> u64;
    /// Capacity and free bytes over the data nodes.
    fn fs_stat(&self) -> FsStat;
    /// Wall-clock time, ns since the Unix epoch (file timestamps).
    fn wall_ns(&self) -> u64;
    /// Monotonic time since a fixed start (lock-tree grace periods).
    fn elapsed(&self) -> Duration;
}

/// Allocation bookkeeping of one simulated node: live extents by offset.
#[derive(Default)]
struct SimNode {
    live: BTreeMap<u64, u64>,
    next: u64,
    used: u64,
    history: TagHistory,
}

/// An in-memory [`Storage`]: `nodes` data nodes of `capacity` bytes each, each a real region
/// (node 0's holds records, tables and lock trees). Freed memory is not reused, so a stale
/// offset never aliases a live one. Time stands still until [`MemStorage::advance`]. A test
/// can run code of its own at the start of every call ([`MemStorage::set_hook`]), to interleave
/// clients' one-sided steps with the service's.
pub struct MemStorage {
    regions: Vec<Region>,
    capacity: u64,
    nodes: Vec<Mutex<SimNode>>,
    now: AtomicU64,
    /// Nodes taken out ([`MemStorage::set_down`]): not data nodes, and refuse everything.
    down: Mutex<Vec<u32>>,
    /// Failure domains by node ([`MemStorage::set_domain`]).
    domains: Mutex<BTreeMap<u32, String>>,
    hook: Mutex<Option<Hook>>,
    /// Frees of stripe extents held back ([`MemStorage::hold_frees`]).
    held_frees: Mutex<Option<Vec<(u32, u64, u64)>>>,
}

/// Code run at the start of every [`Storage`] call of a [`MemStorage`].
pub type Hook = Box<dyn FnMut(&MemStorage) + Send>;

impl MemStorage {
    pub fn new(nodes: u32, capacity: u64) -> MemStorage {
        let regions = (0..nodes.max(1))
            .map(|_| {
                Region::create_memfd("rackfs-meta-test", capacity, 1, Access::ALL)
                    .expect("a memfd region for the in-memory storage")
            })
            .collect();
        MemStorage {
            regions,
            capacity,
            nodes: (0..nodes.max(1)).map(|_| Mutex::default()).collect(),
            now: AtomicU64::new(1_000_000_000),
            down: Mutex::default(),
            domains: Mutex::default(),
            hook: Mutex::default(),
            held_frees: Mutex::default(),
        }
    }

    /// Holds frees of stripe extents back from now on (`true`), as a primary holds them until
    /// its standby has the change that released them; `false` forgets those held, as a
    /// primary that dies first never sends them, and frees at once again.
    pub fn hold_frees(&self, hold: bool) {
        *self.held_frees.lock().expect("held frees lock") = hold.then(Vec::new);
    }

    /// Node `node`'s memory.
    pub fn region(&self, node: u32) -> &Region {
        &self.regions[node as usize]
    }

    /// Runs `hook` at the start of every [`Storage`] call from now on.
    pub fn set_hook(&self, hook: Hook) {
        *self.hook.lock().expect("hook lock") = Some(hook);
    }

    fn call_hook(&self) {
        let taken = self.hook.lock().expect("hook lock").take();
        if let Some(mut h) = taken {
            h(self);
            *self.hook.lock().expect("hook lock") = Some(h);
        }
    }

    /// Puts `node` in failure domain `domain`.
    pub fn set_domain(&self, node: u32, domain: &str) {
        self.domains
            .lock()
            .expect("domains lock")
            .insert(node, domain.into());
    }

    /// Takes `node` out: it is no data node any more and refuses every request.
    pub fn set_down(&self, node: u32) {
        self.down.lock().expect("down lock").push(node);
    }

    /// Brings `node` back (its memory as it was).
    pub fn set_up(&self, node: u32) {
        self.down.lock().expect("down lock").retain(|&n| n != node);
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.now.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }

    /// Allocates nothing on `node` below `end` from now on (a standby taking over keeps the
    /// records and tables it mirrored there).
    pub fn reserve_below(&self, node: u32, end: u64) {
        let mut n = self.nodes[node as usize].lock().expect("node lock");
        n.next = n.next.max(end);
    }

    /// Bytes allocated on `node` (freed extents no longer count).
    pub fn used(&self, node: u32) -> u64 {
        self.nodes[node as usize].lock().expect("node lock").used
    }

    /// Refuses `[at, at + len)` on `node` unless it lies inside one live extent; returns the
    /// extent's start.
    fn inside(&self, node: u32, at: u64, len: u64) -> Result<u64, Refusal> {
        let n = self.node(node)?.lock().expect("node lock");
        match n.live.range(..=at).next_back() {
            Some((&o, &l)) if at + len <= o + l => Ok(o),
            _ => Err(Refusal::new(
                ErrorCode::Invalid,
                format!("{len} bytes at {at:#x} are not inside one extent on node {node}"),
            )),
        }
    }

    /// Refuses unless the extent at `base` on `node` is live and tagged `tag`.
    fn owned(&self, node: u32, base: u64, tag: u64) -> Result<(), Refusal> {
        let live = self
            .node(node)?
            .lock()
            .expect("node lock")
            .live
            .contains_key(&base);
        let found = if live {
            self.region(node).load(base).expect("tag inside the region")
        } else {
            0
        };
        if found != tag {
            return Err(Refusal::new(
                ErrorCode::NotFound,
                format!("the extent at {base:#x} on node {node} is not stripe {tag:#x} (tag {found:#x})"),
            ));
        }
        Ok(())
    }

    fn node(&self, node: u32) -> Result<&Mutex<SimNode>, Refusal> {
        if self.down.lock().expect("down lock").contains(&node) {
            return Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("node {node} is down"),
            ));
        }
        self.nodes
            .get(node as usize)
            .ok_or_else(|| Refusal::new(ErrorCode::Unavailable, format!("no node {node}")))
    }
}

impl Storage for MemStorage {
    fn data_nodes(&self) -> Vec<u32> {
        let down = self.down.lock().expect("down lock");
        (0..self.nodes.len() as u32)
            .filter(|n| !down.contains(n))
            .collect()
    }

    fn cluster_size(&self) -> usize {
        self.nodes.len()
    }

    fn alloc(&self, node: u32, len: u64, tag: Option<u64>) -> Result<u64, Refusal> {
        self.call_hook();
        let mut n = self.node(node)?.lock().expect("node lock");
        let (len, align) = match tag {
            Some(_) => ((len + TAG_SPACE).next_multiple_of(64), 64),
            None => (len.next_multiple_of(64), 64),
        };
        let offset = n.next.next_multiple_of(align);
        if offset + len > self.capacity {
            return Err(Refusal::new(
                ErrorCode::OutOfMemory,
                format!("node {node} has no {len} bytes left"),
            ));
        }
        n.next = offset + len;
        n.used += len;
        n.live.insert(offset, len);
        if let Some(t) = tag {
            self.region(node)
                .store(offset, t)
                .expect("tag inside the region");
        }
        Ok(offset)
    }

    fn free(&self, node: u32, offset: u64, tag: Option<u64>) -> Result<(), Refusal> {
        self.call_hook();
        if let (Some(held), Some(t)) = (&mut *self.held_frees.lock().expect("held frees lock"), tag)
        {
            held.push((node, offset, t));
            return Ok(());
        }
        let moved = tag.is_some_and(|t| {
            self.node(node)
                .is_ok_and(|n| n.lock().expect("node lock").history.moved_from(offset, t))
        });
        if let (Some(t), false) = (tag, moved) {
            self.owned(node, offset, t)?;
        }
        let mut n = self.node(node)?.lock().expect("node lock");
        n.history.forget(offset);
        let len = n.live.remove(&offset).ok_or_else(|| {
            Refusal::new(
                ErrorCode::NotFound,
                format!("no extent at {offset:#x} on node {node}"),
            )
        })?;
        n.used -= len;
        self.region(node)
            .discard(offset, len)
            .expect("extent in region");
        Ok(())
    }

    fn resize(
        &self,
        node: u32,
        offset: u64,
        len: u64,
        tag: u64,
        expect: u64,
    ) -> Result<u64, Refusal> {
        self.call_hook();
        self.owned(node, offset, expect)?;
        let old = self
            .node(node)?
            .lock()
            .expect("node lock")
            .live
            .get(&offset)
            .copied()
            .ok_or_else(|| {
                Refusal::new(
                    ErrorCode::NotFound,
                    format!("no extent at {offset:#x} on node {node}"),
                )
            })?;
        let new = self.alloc(node, len, Some(tag))?;
        let r = self.region(node);
        r.store(offset, 0).expect("tag inside the region");
        r.copy_within(
            offset + TAG_SPACE,
            new + TAG_SPACE,
            (old - TAG_SPACE).min(len),
        )
        .expect("extents in region");
        self.node(node)?
            .lock()
            .expect("node lock")
            .history
            .moved(offset, expect, new, tag);
        Ok(new)
    }

    fn zero(&self, node: u32, offset: u64, len: u64, expect: u64) -> Result<(), Refusal> {
        self.call_hook();
        let base = self.inside(node, offset, len)?;
        self.owned(node, base, expect)?;
        self.region(node)
            .discard(offset, len)
            .expect("extent in region");
        Ok(())
    }

    fn retag(&self, node: u32, offset: u64, expect: u64, tag: u64) -> Result<(), Refusal> {
        self.call_hook();
        self.owned(node, offset, expect)?;
        self.region(node)
            .store(offset, tag)
            .expect("tag inside the region");
        self.node(node)?
            .lock()
            .expect("node lock")
            .history
            .retagged(offset, expect);
        Ok(())
    }

    fn resolve(&self, node: u32, extents: &[(u64, u64)]) -> Result<Resolved, Refusal> {
        self.call_hook();
        let n = self.node(node)?.lock().expect("node lock");
        let region = self.region(node);
        let live = |base| {
            n.live
                .contains_key(&base)
                .then(|| region.load(base).expect("tag inside the region"))
                .filter(|&t| t != 0)
        };
        Ok(n.history.resolve(extents, live))
    }

    fn copy(
        &self,
        src: u32,
        from: u64,
        expect: u64,
        dst: u32,
        to: u64,
        len: u64,
    ) -> Result<(), Refusal> {
        self.call_hook();
        self.owned(src, from - TAG_SPACE, expect)?;
        self.inside(src, from, len)?;
        self.inside(dst, to, len)?;
        let mut bytes = vec![0u8; len as usize];
        self.region(src)
            .read(from, &mut bytes)
            .expect("extent in region");
        self.region(dst)
            .write(to, &bytes)
            .expect("extent in region");
        Ok(())
    }

    fn domain(&self, node: u32) -> Option<String> {
        self.domains
            .lock()
            .expect("domains lock")
            .get(&node)
            .cloned()
    }

    fn local(&self) -> (u32, &Region) {
        (0, &self.regions[0])
    }

    fn meta_alloc(&self, len: u64) -> Result<u64, Refusal> {
        self.alloc(0, len, None)
    }

    fn meta_free(&self, offset: u64, _: u64) {
        let _ = self.free(0, offset, None);
    }

    fn load(&self, offset: u64) -> u64 {
        self.regions[0].load(offset).expect("word in region")
    }

    fn fs_stat(&self) -> FsStat {
        let nodes: Vec<NodeSpace> = self
            .data_nodes()
            .into_iter()
            .map(|node| NodeSpace {
                node,
                capacity: self.capacity,
                free: self.capacity.saturating_sub(self.used(node)),
            })
            .collect();
        FsStat {
            capacity: nodes.iter().map(|n| n.capacity).sum(),
            free: nodes.iter().map(|n| n.free).sum(),
            nodes,
            ..FsStat::default()
        }
    }

    fn wall_ns(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.now.load(Ordering::SeqCst))
    }
}
