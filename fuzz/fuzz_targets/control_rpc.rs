//! The control-RPC decoders on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rackfs_memnode::control::{ControlRequest, ControlResponse};

fuzz_target!(|data: &[u8]| {
    if let Ok((id, req)) = ControlRequest::decode(data) {
        // What decodes re-encodes to the same bytes.
        assert_eq!(req.encode(id), data);
    }
    let _ = ControlResponse::decode(data);
});
