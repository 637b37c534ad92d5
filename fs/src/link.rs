//! Control connections as the client core uses them: [`rackfs_proto::link`], re-exported here
//! so the core and its tests name them as before. A [`ControlLink`] carries one connection's
//! requests and answers, a [`Dial`] opens them: [`NetDial`] over the network, [`Loopback`] in
//! process. The invariants the core relies on are stated in [`rackfs_proto::link`].

pub use rackfs_proto::link::{Closed, ControlLink, Dial, Loopback, NetDial, Serve};
