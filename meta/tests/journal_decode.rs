//! What a standby decodes from the wire (journal entries, a snapshot's namespace) never
//! panics on arbitrary bytes, and replaying whatever decodes fails cleanly or applies.

use proptest::prelude::*;
use rackfs_meta::{journal, Entry, MemStorage, Namespace, Storage};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_journal_bytes_never_panic_the_standby(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let st = MemStorage::new(1, 1 << 20);
        let mut ns = Namespace::new(st.wall_ns());
        if let Ok(entries) = postcard::from_bytes::<Vec<Entry>>(&bytes) {
            for e in entries {
                let _ = journal::replay(&mut ns, st.local().1, e);
            }
        }
        let _ = postcard::from_bytes::<Namespace>(&bytes);
    }
}
