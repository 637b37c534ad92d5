//! The tcp transport's frame reader and every frame-body decoder, on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rackfs_verbs::wire::{self, Challenge, Hello, RdmaAccept, Welcome};

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let mut body = Vec::new();
    // A stream of frames, as a NIC thread reads them.
    while let Ok(kind) = wire::read_frame(&mut input, &mut body) {
        let _ = kind;
        let _ = wire::decode_verbs_request(&body);
        let _ = Hello::decode(&body);
        let _ = Challenge::decode(&body);
        let _ = Welcome::decode(&body);
        let _ = RdmaAccept::decode(&body);
    }
    let _ = wire::decode_verbs_request(data);
});
