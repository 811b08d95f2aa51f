// fusemoe's internal assertion for host code that runs after src/api has validated the call
// (pipelines, launchers, kernel launch wrappers): a failure is a bug in fusemoe, reported as an
// error naming the condition (never undefined behaviour on the device).
#pragma once

#include "fusemoe/error.h"

#define FUSEMOE_ASSERT(cond) FUSEMOE_CHECK(cond, "internal error: assertion `" #cond "` failed")
