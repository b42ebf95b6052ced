"""The gateway: meshserve.v1.Inference in front of several instance pools (routing on load reports, slow-node
isolation, long lane, admission, async jobs, auth). Talks to instances over gRPC only; never imports serving.core."""
