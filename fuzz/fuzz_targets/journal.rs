//! A standby's decoders (journal entries, a snapshot's namespace) and the replay of whatever
//! decodes, on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rackfs_meta::{journal, Entry, MemStorage, Namespace, Storage};

fuzz_target!(|data: &[u8]| {
    let st = MemStorage::new(1, 1 << 20);
    let mut ns = Namespace::new(st.wall_ns());
    if let Ok(entries) = postcard::from_bytes::<Vec<Entry>>(data) {
        for e in entries {
            let _ = journal::replay(&mut ns, st.local().1, e);
        }
    }
    let _ = postcard::from_bytes::<Namespace>(data);
});
