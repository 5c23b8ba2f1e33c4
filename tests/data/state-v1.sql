BEGIN TRANSACTION;
CREATE TABLE jobs (
            job_id TEXT PRIMARY KEY, spec BLOB NOT NULL, state TEXT NOT NULL,
            generation INTEGER NOT NULL, reason TEXT NOT NULL, world TEXT NOT NULL);
INSERT INTO "jobs" VALUES('rl',X'08031A0B0A07747261696E657210011A0B0A07726F6C6C6F7574100222270A0F5745494748545F5452414E534645521A140A07747261696E65721207726F6C6C6F757418012A0F5745494748545F5452414E5346455232056E6F64653132056E6F646532','formed',1,'','[["0000000000000001", "node1", "10.0.0.1", 29500, null, null, "rollout", null, null], ["0000000000000002", "node1", "10.0.0.1", 29501, null, null, "trainer", null, null], ["0000000000000003", "node1", "10.0.0.1", 29502, null, null, "rollout", null, null]]');
INSERT INTO "jobs" VALUES('grow',X'0804121C0802100118012801320E74702D63702D65702D64702D70703A0274703A0408021000','formed',2,'','[["0000000000000004", "node10", "10.0.0.10", 32000, null, null, "", 0, 0], ["0000000000000005", "node10", "10.0.0.10", 32001, null, null, "", 0, 1], ["0000000000000006", "node9", "10.0.0.9", 31002, null, null, "", null, null], ["0000000000000007", "node9", "10.0.0.9", 31003, null, null, "", null, null]]');
INSERT INTO "jobs" VALUES('forming',X'0803','forming',0,'','[]');
INSERT INTO "jobs" VALUES('failed',X'0802','failed',0,'node ''x'' has 1 workers but one asked for local_rank 1','[]');
CREATE TABLE members (
            job_id TEXT NOT NULL, member_id TEXT NOT NULL, seq INTEGER NOT NULL,
            node_key TEXT NOT NULL, address TEXT NOT NULL, master_port INTEGER NOT NULL,
            local_rank INTEGER, node_rank INTEGER, role TEXT NOT NULL, in_world INTEGER NOT NULL,
            PRIMARY KEY (job_id, member_id));
INSERT INTO "members" VALUES('rl','0000000000000001',1,'node1','10.0.0.1',29500,NULL,NULL,'rollout',1);
INSERT INTO "members" VALUES('rl','0000000000000002',2,'node1','10.0.0.1',29501,NULL,NULL,'trainer',1);
INSERT INTO "members" VALUES('rl','0000000000000003',3,'node1','10.0.0.1',29502,NULL,NULL,'rollout',1);
INSERT INTO "members" VALUES('grow','0000000000000004',4,'node10','10.0.0.10',32000,NULL,NULL,'',1);
INSERT INTO "members" VALUES('grow','0000000000000005',5,'node10','10.0.0.10',32001,NULL,NULL,'',1);
INSERT INTO "members" VALUES('grow','0000000000000006',6,'node9','10.0.0.9',31002,NULL,NULL,'',1);
INSERT INTO "members" VALUES('grow','0000000000000007',7,'node9','10.0.0.9',31003,NULL,NULL,'',1);
INSERT INTO "members" VALUES('forming','abababababababab',8,'n1','10.0.0.5',33000,1,NULL,'',0);
INSERT INTO "members" VALUES('failed','0000000000000008',9,'x','10.0.0.7',34000,1,NULL,'',0);
INSERT INTO "members" VALUES('failed','0000000000000009',10,'y','10.0.0.8',34001,NULL,NULL,'',0);
COMMIT;
