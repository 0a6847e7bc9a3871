// An in-process fabric backend for engine tests and the fuzzer: every node
// opened while it is installed is a node of one fabric in this process, with
// its area in ordinary memory, so two engine nodes talk without a second
// process and a test can reach into any of them. It keeps the transport
// contract (docs/transport.md) as the emulated backend's strict mode does:
// posts are the only writes into a peer's area, doorbells ring whatever the
// mask, moves check the window.
#pragma once

#include <cstdint>

#include "fabric/fabric.hpp"

namespace pcientb::test::fake {

// Installs the fake backend (once; before the first node is opened). Every
// node opened from then on, whatever the fabric's name, joins the one fake
// fabric with the next LID (1, 2, ...).
void install();

// The area of the node with that LID, as the node itself sees it.
void *area(uint16_t lid);

// Doorbells rung for the node with that LID are dropped while `deaf`, and its
// polls set no mask: its progress thread leaves what peers post to the node's
// own polls (but for its once-a-second membership check).
void deafen(uint16_t lid, bool deaf);

// Each move the node with that LID makes out of a peer's window (a pull, a READ)
// takes `us` microseconds more: a busy host, or a pull across a bridge.
void slow_reads(uint16_t lid, uint32_t us);

// The node with that LID dies: its peers see it dead (Peer::live, death_fd)
// and its area takes no more posts.
void kill(uint16_t lid);

}  // namespace pcientb::test::fake
