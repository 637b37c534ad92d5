//! A record-lock table as mounts read it (whatever another mount, a torn write or a bug left
//! there), and the POSIX plan made on it for an arbitrary request: neither may panic, and a
//! plan only ever changes free entries and the requester's own.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rackfs_locks::record::{decode, plan, Mode, Want, ENTRY_LEN};

fuzz_target!(|data: &[u8]| {
    if data.len() < 20 {
        return;
    }
    let (head, table) = data.split_at(20);
    let word = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().unwrap());
    let mode = match head[16] % 3 {
        0 => Mode::Shared,
        1 => Mode::Exclusive,
        _ => Mode::Unlock,
    };
    let (start, len) = (word(0), word(8));
    let w = Want {
        client: head[17] as u16,
        host: 1,
        owner: head[18] as u64,
        pid: 1,
        start,
        end: start.saturating_add(len.max(1)),
        mode,
    };
    let slots = decode(&table[..table.len() / ENTRY_LEN as usize * ENTRY_LEN as usize]);
    if let Ok(writes) = plan(&slots, &w) {
        for (i, _) in writes {
            assert!(slots[i].is_none_or(|e| (e.client, e.owner) == (w.client, w.owner)));
        }
    }
});
