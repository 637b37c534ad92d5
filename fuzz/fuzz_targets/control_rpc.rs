//! The control-RPC decoders on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rackfs_proto::control::{ControlRequest, ControlResponse};

fuzz_target!(|data: &[u8]| {
    if let Ok((id, req)) = ControlRequest::decode(data) {
        // What decodes survives a round trip through its own encoding.
        assert_eq!(ControlRequest::decode(&req.encode(id)).expect("re-decodes"), (id, req));
    }
    let _ = ControlResponse::decode(data);
});
