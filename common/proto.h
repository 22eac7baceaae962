/* proto.h — wire-protocol constants shared by servers, clients and tests.
 * The messages themselves are in proto/ (generated into build/gen, never committed). */
#ifndef ZPS_COMMON_PROTO_H
#define ZPS_COMMON_PROTO_H

#include "example.pb-c.h"
#include "zps.pb-c.h"

/* Bumped on any change to the meaning of a message; a mismatch is refused at REGISTER. */
#define ZPS_PROTOCOL_VERSION 1u

/* Upper bound for a Header frame; anything larger is rejected before unpacking. */
#define ZPS_HEADER_MAX_BYTES (1u << 20)

#endif
